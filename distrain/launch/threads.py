"""Intra-op threads for the training thread alone, so that no other thread of a rank gets an OpenMP team.

Why: libgomp, the OpenMP runtime of torch's Linux CPU builds, gives every thread that runs a parallel ATen loop a
team of its own, and a thread takes torch's process-wide thread count the first time it runs one. Once libgomp
manages more threads than the machine has CPUs it stops spinning between parallel regions and sleeps instead, so
each of a step's thousands of small parallel loops waits for a wake-up. gloo's worker threads run the copies of
object collectives (DCP's plans and metadata at every checkpoint save and load), so after the first save of a
one-rank CPU job its steps took about twice as long (issue 41). With ``use_intra_op_threads(n)`` the training
thread keeps ``n`` threads while every thread that starts its first parallel loop later runs its loops serially.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch


@functools.cache
def _torch_cpu() -> ctypes.CDLL | None:
    """torch's own CPU library; a symbol looked up through it resolves in the libraries it links (its OpenMP runtime
    and MKL), not in another copy some other package loaded. None where there is none to open."""
    path = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    try:
        return ctypes.CDLL(str(path)) if path.is_file() else None
    except OSError:
        return None


def use_intra_op_threads(threads: int) -> None:
    """Run this thread's parallel ATen loops on ``threads`` threads, and those of every thread that starts its
    first parallel loop later (gloo's workers, the comm hooks' and data prefetch threads, an asynchronous save's
    writer) on one: ranks share the machine's cores, which the training thread already uses.

    Where torch's library or its OpenMP entry cannot be reached (not Linux), or the training thread would not keep
    its ``threads``, this is ``torch.set_num_threads(threads)``.
    """
    torch.set_num_threads(threads)
    torch.get_num_threads()  # this thread takes its settings now (once per thread), before the default changes
    library = _torch_cpu()
    if threads == 1 or library is None or not hasattr(library, "omp_set_num_threads"):
        return
    torch.set_num_threads(1)  # the default a thread takes at its first parallel loop
    library.omp_set_num_threads(threads)  # ... while this thread's own OpenMP setting stays
    if hasattr(library, "MKL_Set_Num_Threads_Local"):  # MKL's C entry (an int argument), per thread as torch sets it
        library.MKL_Set_Num_Threads_Local(threads)
    if torch.get_num_threads() != threads:  # another OpenMP runtime answered: keep torch's own behaviour
        torch.set_num_threads(threads)
