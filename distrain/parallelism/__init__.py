"""Parallelism strategies, one module per option of the ``parallelism`` config group."""
