"""Data: token corpora, a global-batch sampler sharded over data-parallel ranks, and batches."""
