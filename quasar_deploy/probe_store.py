"""Kernel timings kept across processes.

A timing that picks between kernels of equal results (``kernels.int8_probe``) can come out either way where two
kernels run alike (seen on the Intel Xeon kind: 7% apart, a different pick from one process to the next). The pick
decides more than the kernel: ``auto`` runs an artifact on the cpu backend or on ONNX Runtime by it, and the two round
floats differently. So a timing is taken once per CPU, thread count and software (the key) and kept in the cache:
every process on the machine then chooses alike, the server and the benchmark that started it, today's ``generate``
and tomorrow's. ``QUASAR_REPROBE=1`` times again and keeps the new result.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
from pathlib import Path

REPROBE_ENV = "QUASAR_REPROBE"


def kept_path(key: dict) -> Path:
    """Where the timing for ``key`` is kept: beside the kernels built for this machine, one file per key."""
    from .cache import cache_dir

    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "kernels" / f"probe-{key['probe']}-{digest}.json"


def recall(key: dict) -> tuple[dict, str] | None:
    """The result kept for ``key`` and when it was timed (UTC date), or None: nothing kept, a file that is not a
    record for this key, or ``QUASAR_REPROBE`` set."""
    from .cache import read_json

    if os.environ.get(REPROBE_ENV):
        return None
    record = read_json(kept_path(key))
    if record.get("key") != key or not isinstance(record.get("result"), dict):
        return None
    return record["result"], str(record.get("date"))


def keep(key: dict, result: dict) -> str:
    """Keep ``result`` for ``key``, replacing the file whole, and return when it was timed (now, UTC); a cache that
    cannot be written leaves the next process to time again."""
    from .cache import write_json

    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    try:
        write_json(kept_path(key), {"key": key, "result": result, "date": date})
    except OSError:
        pass
    return date
