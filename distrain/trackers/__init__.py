"""Where metrics go: the run directory (always), an optional experiment tracker, the console."""
