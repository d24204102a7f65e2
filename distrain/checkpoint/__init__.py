"""Checkpoints: sharded (torch.distributed.checkpoint), atomic, with the data position and RNG state."""
