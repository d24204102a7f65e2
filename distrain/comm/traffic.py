"""Bytes a rank sends for one collective, per the algorithms gloo and NCCL use for large messages.

These are the figures distrain reports as ``grad_bytes_sent``. They were checked against the bytes gloo actually
writes to its sockets (``/proc/self/io``'s ``wchar``; see tests/distributed/test_comm.py):

- all-reduce (ring): ``2 (n-1)/n`` times the buffer, on every rank;
- all-gather (ring): ``n-1`` times this rank's contribution;
- reduce to one root: the buffer on every non-root rank, ``(n-1)/n`` of it on the root;
- broadcast (binomial tree): the buffer once per child in the tree, so ``log2 n`` times on the root and 0 on leaves.
"""

from __future__ import annotations


def all_reduce_bytes(nbytes: int, group_size: int) -> int:
    return 2 * (group_size - 1) * nbytes // group_size


def all_gather_bytes(nbytes_per_rank: int, group_size: int) -> int:
    return (group_size - 1) * nbytes_per_rank


def reduce_bytes(nbytes: int, group_size: int, is_root: bool) -> int:
    return (group_size - 1) * nbytes // group_size if is_root else nbytes if group_size > 1 else 0


def broadcast_bytes(nbytes: int, group_size: int, index_from_root: int) -> int:
    """``index_from_root``: this rank's position in the group counted from the root (root = 0)."""
    children, span = 0, 1
    while span <= index_from_root:
        span *= 2
    while index_from_root + span < group_size:
        children += 1
        span *= 2
    return children * nbytes
