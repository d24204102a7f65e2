"""Document masking (``data.document_masking=true``): the documents packed into one window stay apart.

A prepared dataset joins its documents, each followed by the end-of-document id, and cuts windows across them, so
a window holds the end of one document, whole documents, and the start of another. With masking every token gets
its document's number inside the window (the end-of-document token belongs to the document it ends); the model
restarts positions at each document and attends only inside it (``distrain.models.common.documents``), and the
target of an end-of-document input, the first token of the next, unrelated document, is not counted in the loss.

Only the counted targets enter the loss, and they differ from rank to rank, so every rank divides its summed loss
by the step's counted tokens per data-parallel rank (``count_step_tokens``, one all-reduce of one number per step)
instead of its own count: the data-parallel mean of the gradients is then the gradient of the global batch's
token mean, the same on any number of ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
import torch.distributed as dist

from distrain.data.sampler import IGNORE_INDEX, Batch


def mask_documents(batch: Batch, eos_id: int) -> Batch:
    """``batch`` with each input token's document number (``documents``) and the targets of end-of-document inputs
    set to ``IGNORE_INDEX``; on the batch's device, no collective."""
    ends = batch.inputs == eos_id
    # Exclusive count of the ends before each token: the end-of-document token stays in the document it ends.
    documents = torch.cumsum(ends, dim=1) - ends.long()
    return replace(batch, targets=batch.targets.masked_fill(ends, IGNORE_INDEX), documents=documents)


def count_step_tokens(micro_batches: Sequence[Batch], device: torch.device) -> list[Batch]:
    """The step's ``micro_batches`` with ``step_tokens`` set to the mean over all ranks of the tokens each rank's
    batches count (ranks reading the same batches, the tensor-, context- and pipeline-parallel peers of a
    data-parallel rank, count alike, so it is the mean over data-parallel ranks). One all-reduce of one float64
    on ``device`` over the default group; nothing runs for batches without documents (every rank counts alike)."""
    if not micro_batches or micro_batches[0].documents is None:
        return list(micro_batches)
    counted = torch.tensor([float(sum(batch.num_tokens for batch in micro_batches))], dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        counted = counted.to(device)
        dist.all_reduce(counted)
        counted = counted / dist.get_world_size()
    # Never zero: a step whose windows are all ends of documents counts nothing and its loss is then 0, not NaN.
    step_tokens = max(float(counted.item()), 1.0)
    return [replace(batch, step_tokens=step_tokens) for batch in micro_batches]
