"""Models, one folder per family (``model.py``, ``spec.py``, ``config.py``). Each maps token ids of shape
(batch, seq) to logits of shape (batch, seq, vocab) and declares how it is split in its ``ModelSpec``
(``distrain.models.spec``)."""
