"""Handing a model's OpenMP work from the thread that loaded it to a worker thread, at full speed.

GNU OpenMP keeps a worker pool per thread that ran a parallel region; once they outnumber the CPUs, each region pays a
wake-up, so the loading thread gives its pool back (``release_openmp_pool``).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import torch  # noqa: F401  (loads its OpenMP runtime into the process: runtime_functions finds its symbols)

OMP_PAUSE_SOFT = 1  # OpenMP 5.0's omp_pause_soft: free the calling thread's pool; it is rebuilt if that thread runs again


def runtime_functions(*names: str) -> list[Callable] | None:
    """The functions ``names`` of the OpenMP runtime torch has loaded (GNU's or Intel's), or None where any is missing."""
    try:
        process = ctypes.CDLL(None)
        return [getattr(process, name) for name in names]
    except (AttributeError, OSError):
        return None


@functools.cache
def parallel_entry_points() -> tuple[int, ...] | None:
    """GOMP_parallel, omp_get_thread_num and omp_get_num_threads of torch's OpenMP runtime, as addresses; None where none."""
    found = runtime_functions("GOMP_parallel", "omp_get_thread_num", "omp_get_num_threads")
    return None if found is None else tuple(ctypes.cast(function, ctypes.c_void_p).value for function in found)


def release_openmp_pool() -> bool:
    """Free the calling thread's OpenMP pool once its parallel work is done (rebuilt if it runs OpenMP again); True if freed."""
    found = runtime_functions("omp_pause_resource_all")
    return found is not None and found[0](OMP_PAUSE_SOFT) == 0
