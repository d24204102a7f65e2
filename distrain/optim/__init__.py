"""Optimizers (weight-decay parameter groups) and learning-rate schedules."""
