"""The cache directory and its upkeep: where quasar-deploy keeps what it derives for the next run (ONNX exports, built
kernels and their timings, the demo's artifacts), JSON records written whole, and the lock writers take.

Each entry's record in ``.index/`` names its sources and when it was last used (``entries``, ``make_room``)."""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from .errors import QuasarError

INDEX = ".index"  # entry records and the checkpoint file hashes; hidden, so never an entry itself
DEFAULT_SHARE = 0.25  # of the cache's disk, when $QUASAR_CACHE_MAX is unset
UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def cache_dir() -> Path:
    """Where quasar-deploy keeps what it derives (ONNX exports, demo artifacts): $QUASAR_CACHE or ~/.cache/quasar-deploy."""
    return Path(os.environ.get("QUASAR_CACHE") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "quasar-deploy")


def write_json(path: Path, data: object) -> None:
    """Replaced whole (a reader never sees half a file; two writers: the last one wins, which an index may lose)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.name}.", delete=False) as tmp:
        tmp.write(json.dumps(data))
    os.replace(tmp.name, path)


def read_json(path: Path) -> dict:
    """The JSON object at ``path``; {} where it is missing, unreadable or not an object."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


@contextmanager
def locked(path: Path) -> Iterator[None]:
    """Held while one process checks for, and writes, ``path``; the lock is on the parent directory (no lock file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(path.parent, os.O_RDONLY)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        yield
    finally:
        os.close(descriptor)


def used(entry: Path, source: Path | None = None) -> None:
    """Record that ``entry`` was just used (for ``source``, a model directory it was derived from)."""
    record_path = entry.parent / INDEX / f"{entry.name}.json"
    sources = read_json(record_path).get("sources", [])
    if source is not None and str(source.resolve()) not in sources:
        sources.append(str(source.resolve()))
    write_json(record_path, {"sources": sources, "last_used": time.time()})


@dataclass(frozen=True)
class Entry:
    """One thing the cache holds: a directory, its size, when it was last used, and the sources recorded for it."""

    path: Path
    bytes: int
    last_used: float
    sources: tuple[str, ...]

    @property
    def orphaned(self) -> bool:
        """Derived from sources of which none is still there (an export of a deleted temporary directory)."""
        return bool(self.sources) and not any(Path(s).exists() for s in self.sources)

    def to_dict(self) -> dict:
        record = {"name": self.path.name, "bytes": self.bytes, "last_used": self.last_used}
        return record | {"sources": list(self.sources), "orphaned": self.orphaned}


def entries(root: Path | None = None) -> list[Entry]:
    """What the cache holds, least recently used first (an entry with no record: its modification time)."""
    root = cache_dir() if root is None else root
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        if path.name.startswith("."):
            continue
        record = read_json(root / INDEX / f"{path.name}.json")
        last = record.get("last_used", path.lstat().st_mtime)
        size = sum(f.lstat().st_size for f in path.rglob("*") if not f.is_dir()) if path.is_dir() else path.lstat().st_size
        found.append(Entry(path, size, last, tuple(record.get("sources", ()))))
    return sorted(found, key=lambda e: e.last_used)


def remove(entry: Entry) -> None:
    """``entry`` and its record."""
    if entry.path.is_dir() and not entry.path.is_symlink():
        shutil.rmtree(entry.path)
    else:
        entry.path.unlink()
    (entry.path.parent / INDEX / f"{entry.path.name}.json").unlink(missing_ok=True)


def clear(older_than_s: float | None = None) -> list[Entry]:
    """Remove every entry, or those last used more than ``older_than_s`` seconds ago; returns what was removed."""
    root = cache_dir()
    gone = []
    with locked(root / INDEX):  # the lock on the cache directory, as exports take it
        for entry in entries(root):
            if older_than_s is None or entry.last_used < time.time() - older_than_s:
                remove(entry)
                gone.append(entry)
    return gone


def parse_size(text: str) -> int:
    """Bytes from ``20G``, ``500MB``, ``1.5T`` or a plain number (decimal units), refused in one line otherwise."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*", text, re.IGNORECASE)
    if not match:
        raise QuasarError(f"not a size: {text!r} (e.g. 20G, 500M, or bytes)")
    return int(float(match[1]) * UNITS[match[2].lower()])


def parse_age(text: str) -> float:
    """Seconds from ``30d``, ``12h``, ``90m`` or ``45s``, refused in one line otherwise."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd])\s*", text, re.IGNORECASE)
    if not match:
        raise QuasarError(f"not an age: {text!r} (e.g. 30d, 12h, 90m, 45s)")
    return float(match[1]) * SECONDS[match[2].lower()]


def _disk(root: Path):
    """The disk ``root`` is (or will be) on: its nearest existing directory's, so asking creates nothing."""
    while not root.exists() and root != root.parent:
        root = root.parent
    return shutil.disk_usage(root)


def disk_free() -> int:
    """Bytes free on the disk the cache is (or will be) on."""
    return _disk(cache_dir()).free


def size_limit() -> int:
    """$QUASAR_CACHE_MAX, or ``DEFAULT_SHARE`` of the disk the cache is on."""
    text = os.environ.get("QUASAR_CACHE_MAX")
    return parse_size(text) if text else int(DEFAULT_SHARE * _disk(cache_dir()).total)


def make_room(need: int, keep: tuple[Path, ...] = ()) -> list[Entry]:
    """Evict least recently used entries (never ``keep``) until ``need`` more bytes fit, or refuse; under the cache lock."""
    root, limit = cache_dir(), size_limit()
    if need > limit:
        raise QuasarError(f"the cache needs {need / 1e9:.1f} GB for this, over its limit of {limit / 1e9:.1f} GB (raise QUASAR_CACHE_MAX)")
    present = entries(root)
    total = sum(e.bytes for e in present)
    evicted = []
    for entry in present:
        if total + need <= limit:
            break
        if entry.path.resolve() not in keep:
            remove(entry)
            total -= entry.bytes
            evicted.append(entry)
    free = _disk(root).free
    if need > free:
        raise QuasarError(
            f"not enough disk space in {root}: this needs {need / 1e9:.1f} GB, {free / 1e9:.1f} GB free (or set QUASAR_CACHE)"
        )
    return evicted
