"""What document masking asks of a model (``data.document_masking=true``, ``distrain.data.packing``): from each
token's document number inside its sequence, the token's position inside its document and the attention mask that
keeps every query inside its own document.

Both are computed on the documents' device, in the forward that needs them, without a collective: every rank of a
context-parallel group holds the documents of the whole sequence, so a rank's queries are masked against every
key's document wherever the key lives.
"""

from __future__ import annotations

import torch
from torch import Tensor


def document_positions(documents: Tensor) -> Tensor:
    """The position of each token inside its document (long, like ``documents`` (batch, seq)): 0 at the first
    token of every document, the sequence's first token included."""
    seq = documents.shape[-1]
    index = torch.arange(seq, device=documents.device).expand_as(documents)
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[..., 1:] = documents[..., 1:] != documents[..., :-1]
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=-1).values
    return index - first


def document_attention_mask(documents: Tensor, query_positions: Tensor | None = None) -> Tensor:
    """Which keys each query may attend to: keys not after it in its own document, as a bool (batch, 1, queries,
    seq) mask for ``scaled_dot_product_attention`` (True: attend). ``query_positions`` (long, (queries,)) are the
    sequence positions of the queries this rank holds (context parallelism's share); None: every position."""
    keys = torch.arange(documents.shape[-1], device=documents.device)
    queries = keys if query_positions is None else query_positions
    same_document = documents[:, queries, None] == documents[:, None, :]
    return (same_document & (queries[:, None] >= keys[None, :])).unsqueeze(1)
