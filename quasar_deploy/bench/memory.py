"""Whether a benchmark fits in this machine's memory, asked before it allocates anything.

A benchmark of a published shape that does not fit is killed by the kernel's OOM killer minutes
in, with nothing to say why; the estimate (from the shape's tensor sizes) refuses it up front.
"""

from __future__ import annotations

import sys
from pathlib import Path

from ..errors import QuasarError

GB = 10**9


def memory_available(meminfo: Path = Path("/proc/meminfo")) -> int:
    """MemAvailable (what can be allocated without swapping), in bytes; unknown (not Linux): unlimited."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return sys.maxsize


def check_fits(needed: int, what: str, available: int | None = None) -> None:
    """Refuse ``what`` when its estimated peak (bytes) exceeds ``available`` (default: MemAvailable now)."""
    available = memory_available() if available is None else available
    if needed > available:
        raise QuasarError(f"{what} needs ~{needed / GB:.1f} GB, this machine has {available / GB:.1f} GB available")
