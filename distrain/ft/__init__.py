"""Fault tolerance across data-parallel replica groups (``ft`` config group): torchft's quorum, healing and commit."""
