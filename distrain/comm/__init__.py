"""Gradient communication: DDP reducer settings and communication hooks."""
