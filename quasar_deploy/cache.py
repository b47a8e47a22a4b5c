"""What quasar-deploy derives from a model and keeps for the next run: the cache directory, the ONNX export that the
onnxruntime backend runs when it is handed an artifact or a checkpoint instead of an export, and the cache's upkeep.

An export is keyed by its source's content alone, so a changed model gets a new export, and the same model copied or
re-created elsewhere (a temporary directory) finds the export it already has. An artifact's ``quasar.json`` lists the
sha256 of every file it holds, so its bytes name the artifact's content. A float checkpoint has no such record: its
files are hashed, once per file version (size, modification time, inode; remembered in ``.index/hashes.json``), since
hashing 16 GB on every load would cost more than the backend saves.

Each entry's record in ``.index/`` says which source paths it was made from or used for, and when it was last used:
``cache list`` reports an entry whose sources are all gone as orphaned, and a new export first evicts the least recently
used entries until it fits under ``$QUASAR_CACHE_MAX`` (default a quarter of the cache's disk), then checks the disk has
room for it. Writers take a lock on the cache directory, so two processes started together export once; the export
itself is atomic (``files.atomic_directory``), and the loader checks every file against the export's manifest before it runs.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from .errors import QuasarError
from .exporters import ONNX_GRAPH_REVISION
from .files import TOKENIZER_FILES, sha256_files
from .integrity import EXPORT_FORMAT_VERSION, MANIFEST

INDEX = ".index"  # entry records and the checkpoint file hashes; hidden, so never an entry itself
HASHES = "hashes.json"
DEFAULT_SHARE = 0.25  # of the cache's disk, when $QUASAR_CACHE_MAX is unset
UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def cache_dir() -> Path:
    """Where quasar-deploy keeps what it derives (ONNX exports, demo artifacts): $QUASAR_CACHE or ~/.cache/quasar-deploy."""
    root = os.environ.get("QUASAR_CACHE") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "quasar-deploy"
    return Path(root)


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


def _file_sha256(file: Path, known: dict) -> str:
    """sha256 of ``file``, from ``known`` while the file is the same version (size, mtime, inode), else read and added."""
    stat = file.stat()
    version = [stat.st_size, stat.st_mtime_ns, stat.st_ino]
    entry = known.get(str(file.resolve()))
    if entry is None or entry[:3] != version:
        entry = known[str(file.resolve())] = [*version, sha256_files(file)]
    return entry[3]


def content_key(model: Path) -> str:
    """sha256 naming what ``model`` holds: its artifact record, or the sha256 of each file of a checkpoint an export reads
    (config, weights, tokenizer)."""
    from ._version import __version__

    digest = hashlib.sha256(json.dumps([__version__, EXPORT_FORMAT_VERSION, ONNX_GRAPH_REVISION]).encode())
    if (model / MANIFEST).is_file():
        digest.update((model / MANIFEST).read_bytes())
        return digest.hexdigest()
    if not (model / "config.json").is_file():
        raise QuasarError(f"{model}: no config.json (not a Hugging Face checkpoint or a quasar-deploy artifact)")
    hashes = cache_dir() / INDEX / HASHES
    known = read_json(hashes)
    before = json.dumps(known, sort_keys=True)
    read = {"config.json", *TOKENIZER_FILES}
    for file in sorted(f for f in model.iterdir() if f.is_file() and (f.name in read or ".safetensors" in f.name)):
        digest.update(json.dumps([file.name, _file_sha256(file, known)]).encode())
    if json.dumps(known, sort_keys=True) != before:
        write_json(hashes, known)
    return digest.hexdigest()


def head_outside(model: Path) -> bool:
    """Whether ``model``'s cached export leaves its float lm_head to the backend: a W8A8 artifact whose head runs better
    on torch beside the graph (``kernels.head_beside_graph``: in bf16 where the CPU computes it, else read as stored in
    16 bits by ``quasar-half``; ORT's CPU kernels have no bf16 MatMul, and a float32 head reads twice the bytes)."""
    from .checkpoint import Checkpoint
    from .kernels import head_beside_graph
    from .memory import head_dtype_name
    from .shards import TORCH_DTYPES

    if not (model / MANIFEST).is_file():
        return False
    return head_beside_graph(TORCH_DTYPES[head_dtype_name(Checkpoint(model).dtypes)])


def onnx_export_path(model: Path) -> Path:
    """Where the ONNX export of ``model`` is cached: named by its content key alone (not by where the model is), and by
    where its head runs (``head_outside``)."""
    return cache_dir() / f"onnx-{content_key(model)[:24]}{'-head-outside' if head_outside(model) else ''}"


@contextmanager
def locked(path: Path) -> Iterator[None]:
    """Held while one process checks for, and writes, ``path``: a second process waits, then finds it written. The lock
    is on the parent directory itself, so no lock file is left beside what the cache holds."""
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
    record = read_json(record_path)
    sources = record.get("sources", [])
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
        return {
            "name": self.path.name,
            "bytes": self.bytes,
            "last_used": self.last_used,
            "sources": list(self.sources),
            "orphaned": self.orphaned,
        }


def _size(path: Path) -> int:
    if not path.is_dir():
        return path.lstat().st_size
    return sum(f.lstat().st_size for f in path.rglob("*") if not f.is_dir())


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
        found.append(Entry(path, _size(path), last, tuple(record.get("sources", ()))))
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
    if text:
        return parse_size(text)
    return int(DEFAULT_SHARE * _disk(cache_dir()).total)


def make_room(need: int, keep: tuple[Path, ...] = ()) -> list[Entry]:
    """Evict least recently used entries (never ``keep``) until ``need`` more bytes fit under the size limit, then refuse in
    one line if the disk itself has no room for them. Called under the cache lock."""
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


def export_bytes(model: Path) -> int:
    """About what the ONNX export of ``model`` takes on disk: its weights as the graph stores them (int8 linears with their
    scales, everything else float32, the embedding table in float32 whatever it is stored in)."""
    import torch

    from .artifact import open_model_files
    from .memory import EMBEDDINGS, estimate

    files = open_model_files(model)
    needed = estimate(files, float_dtype=torch.float32)  # the graph's float weights are float32
    table = 1
    for dim in files.checkpoint.shapes[EMBEDDINGS]:
        table *= dim
    return needed.int8_weights + needed.float_weights + 4 * table


def cached_onnx_export(model: str | Path, replace: bool = False, progress: bool = True) -> Path:
    """The ONNX export of the artifact (exact integer W8A8 graph) or float checkpoint at ``model``, exported on first
    use; ``replace``: export it again (the loader found the cached one damaged: the cache is ours to repair)."""
    from .exporters import export

    model = Path(model)
    path = onnx_export_path(model)
    with locked(path):
        if replace and path.exists():
            shutil.rmtree(path)
        if not path.exists():
            make_room(export_bytes(model), keep=(model.resolve(),))  # the source may be in the cache too (the demo's)
            print(f"quasar-deploy: first use of {model} on ONNX Runtime: exporting it to {path} (once per model)", file=sys.stderr)
            w8a8 = (model / MANIFEST).is_file()
            export(model, "onnx", path, precision="w8a8" if w8a8 else "float", progress=progress, head_outside=head_outside(model))
        used(path, model)
    return path
