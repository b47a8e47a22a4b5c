"""Handing a model's OpenMP work from the thread that loaded it to a worker thread, at full speed.

GNU OpenMP (torch's CPU wheels) keeps one pool of worker threads per thread that has run a parallel region. Once
the threads of all pools outnumber the CPUs, every pool's workers stop spinning between regions and sleep at once, so
each of the decoder's thousands of small parallel regions a step pays a futex wake-up: measured on 2 cores, a verify
step in the server's scheduler thread took 1.5-1.9x the same step in the loading thread, until the loading thread gave
its pool back (``release_openmp_pool``). The server loads its model in the main thread and steps it in the scheduler's.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

OMP_PAUSE_SOFT = 1  # OpenMP 5.0's omp_pause_soft: free the calling thread's pool; it is rebuilt if that thread runs again


def runtime_functions(*names: str) -> list[Callable] | None:
    """The functions ``names`` of the OpenMP runtime torch has loaded (GNU's in its CPU wheels, or Intel's, which exports
    the same names), or None where the process lacks any of them."""
    import torch  # noqa: F401  (loads the runtime into the process, so its symbols are found below)

    try:
        process = ctypes.CDLL(None)
        return [getattr(process, name) for name in names]
    except (AttributeError, OSError):
        return None


@functools.cache
def parallel_entry_points() -> tuple[int, ...] | None:
    """GOMP_parallel, omp_get_thread_num and omp_get_num_threads of the OpenMP runtime torch has loaded, as addresses, for
    our C kernels to share a call among torch's own threads; None where the process has none."""
    found = runtime_functions("GOMP_parallel", "omp_get_thread_num", "omp_get_num_threads")
    return None if found is None else tuple(ctypes.cast(function, ctypes.c_void_p).value for function in found)


def _pause_all() -> Callable[[int], int] | None:
    """``omp_pause_resource_all`` of the OpenMP runtime torch has loaded, or None where there is none."""
    found = runtime_functions("omp_pause_resource_all")
    return found[0] if found else None


def release_openmp_pool() -> bool:
    """Free the calling thread's OpenMP worker pool, for a thread that has finished its parallel work (loading a model)
    and hands the rest to another thread; True when the runtime did. Harmless if the caller runs OpenMP again: its
    pool is rebuilt."""
    pause = _pause_all()
    return pause is not None and pause(OMP_PAUSE_SOFT) == 0
