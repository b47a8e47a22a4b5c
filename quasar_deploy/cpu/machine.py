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
    """Threads to compute with: the CPUs this process may use (affinity, cgroup quota), not the host's cores."""
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
    """Make OpenMP threads sleep, not spin, where the 1-minute load average exceeds the CPUs this process may use, unless the
    user chose a policy. The runtime reads ``OMP_WAIT_POLICY`` as torch loads it, so the CLI calls this before."""
    load = os.getloadavg()[0] if load is None else load
    if load > (cpus or default_threads()):
        environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
