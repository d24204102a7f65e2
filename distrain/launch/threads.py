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

import torch


@functools.cache
def _loaded_library(name: str) -> ctypes.CDLL | None:
    """The shared library this process already loaded whose file name starts with ``name`` (Linux), or None."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/" in line}
    except OSError:  # not Linux: torch's default behaviour stays
        return None
    found = sorted(path for path in paths if path.rsplit("/", 1)[-1].startswith(name))
    return ctypes.CDLL(found[0]) if found else None


def use_intra_op_threads(threads: int) -> None:
    """Run this thread's parallel ATen loops on ``threads`` threads and those of threads started later serially.

    Where the OpenMP runtime is not libgomp loaded from a file (macOS, Windows), this is ``torch.set_num_threads``.
    """
    torch.set_num_threads(threads)
    torch.get_num_threads()  # this thread takes its settings now (once per thread), before the default changes
    gomp = _loaded_library("libgomp")
    if threads == 1 or gomp is None:
        return
    torch.set_num_threads(1)  # the default a thread takes at its first parallel loop
    gomp.omp_set_num_threads(threads)  # ... while this thread's own OpenMP setting stays
    torch_cpu = _loaded_library("libtorch_cpu")
    if torch_cpu is not None and hasattr(torch_cpu, "MKL_Set_Num_Threads_Local"):  # MKL's C entry (int argument)
        torch_cpu.MKL_Set_Num_Threads_Local(threads)  # and MKL's, which torch.set_num_threads also sets per thread
