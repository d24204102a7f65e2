"""Models. Each maps token ids of shape (batch, seq) to logits of shape (batch, seq, vocab)."""
