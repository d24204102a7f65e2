"""Configuration: the typed schemas of every config group (``schema``), closed option sets (``choices``), the
one-line refusal (``checks``), command-line overrides Hydra cannot compose (``overrides``) and the validation run
once before any rank starts (``validate``, which asks each group's own checks)."""
