"""Per-step measurements: phase timing, FLOPs and MFU, memory, rank balance, profiling."""
