"""Command-line tools beside ``train.py``: ``check_model`` (a model under every layout against one process) and
``generate`` (sample from a checkpoint). ``distrain.data.prepare`` and ``distrain.checkpoint.export`` live with the
files they write."""
