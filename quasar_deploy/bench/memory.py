"""Whether a benchmark fits in this machine's memory, asked before it allocates anything.

A published shape that does not fit is killed by the OOM killer minutes in, silently; the estimate refuses it up front."""

from __future__ import annotations

from ..cpu.machine import memory_available
from ..errors import QuasarError

GB = 10**9


def fits(needed: int, available: int | None = None) -> bool:
    """Whether an estimated peak of ``needed`` bytes fits ``available`` (default: MemAvailable now)."""
    return needed <= (memory_available() if available is None else available)


def check_fits(needed: int, what: str, available: int | None = None) -> None:
    """Refuse ``what`` when its estimated peak (bytes) exceeds ``available`` (default: MemAvailable now)."""
    available = memory_available() if available is None else available
    if not fits(needed, available):
        raise QuasarError(f"{what} needs ~{needed / GB:.1f} GB, this machine has {available / GB:.1f} GB available")
