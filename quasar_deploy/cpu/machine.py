"""What this machine is: its CPU, the instruction sets it exposes, the CPUs and memory this process may use. Kernel
choice, thread counts, the backend choice and ``doctor`` read it."""

from __future__ import annotations

import math
import os
import platform
import sys
from collections.abc import MutableMapping
from functools import cache
from pathlib import Path

ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_int8", "amx_bf16", "asimd", "asimddp", "i8mm")


@cache
def cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cgroup_cpu_limit(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """CPUs the cgroup's quota allows (containers: ``docker run --cpus``), from cgroup v2 or v1; None when unlimited."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def default_threads() -> int:
    """Threads to compute with: the CPUs this process may run on and its cgroup quota allows, not the host's cores.

    In a container limited to 2 CPUs on a 64-core host, a library that sizes its thread pool
    from the host runs 32 threads on 2 CPUs, and OpenMP barriers then spin for most of each step.
    """
    try:
        allowed = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        allowed = os.cpu_count() or 1
    limit = cgroup_cpu_limit()
    return max(1, min(allowed, math.ceil(limit) if limit else allowed))


def memory_available(meminfo: Path = Path("/proc/meminfo")) -> int:
    """MemAvailable (what can be allocated without swapping), in bytes; unknown (not Linux): unlimited."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return sys.maxsize


def prefer_passive_waits(environ: MutableMapping[str, str] = os.environ, load: float | None = None, cpus: int | None = None) -> None:
    """Make OpenMP threads sleep, not spin, at the end of a parallel region when the machine is already oversubscribed
    (1-minute load average above the CPUs this process may use), unless the user chose a policy.

    Spinning holds a core another process (or our own other thread) needs: on a busy machine it loses by
    orders of magnitude. On a quiet one it wins, since a verify step is a chain of short parallel regions and
    a sleeping thread takes longer to wake than a spinning one to notice work (``bench verify-step`` with and
    without ``OMP_WAIT_POLICY=PASSIVE`` shows both). The OpenMP runtime reads ``OMP_WAIT_POLICY`` once, when
    torch loads it, so the CLI calls this before any command imports torch.
    """
    load = os.getloadavg()[0] if load is None else load
    if load > (cpus or default_threads()):
        environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
