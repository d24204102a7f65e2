"""Analysis of finished runs: load run directories (or W&B offline runs) into DataFrames and plot comparisons.
Used by the notebooks in ``notebooks/`` and by the benchmark scripts; needs ``pip install -e ".[analysis]"``."""
