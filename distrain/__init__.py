"""distrain: Hydra-configured distributed PyTorch training."""

__version__ = "0.1.0"
