"""What quasar-deploy derives from a model and keeps for the next run: the cache directory, and the ONNX export that
the onnxruntime backend runs when it is handed an artifact or a checkpoint instead of an export.

An export is keyed by what its graph is made of, so a changed model gets a new export and an unchanged one is never
exported twice. An artifact's ``quasar.json`` lists the sha256 of every file it holds, so its bytes name the artifact's
content. A float checkpoint has no such record, and hashing 16 GB on every load would cost more than the backend saves,
so it is keyed by its config and its weight files' sizes and modification times. Writers take a lock on the cache directory,
so two processes started together export once; the export itself is atomic (``files.atomic_directory``), and the loader
checks every file against the export's manifest before it runs.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .errors import QuasarError
from .exporters import ONNX_GRAPH_REVISION
from .integrity import EXPORT_FORMAT_VERSION, MANIFEST


def cache_dir() -> Path:
    """Where quasar-deploy keeps what it derives (ONNX exports, demo artifacts): $QUASAR_CACHE or ~/.cache/quasar-deploy."""
    root = os.environ.get("QUASAR_CACHE") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "quasar-deploy"
    return Path(root)


def content_key(model: Path) -> str:
    """sha256 naming what ``model`` holds: its artifact record, or a checkpoint's config and weight files' sizes and times."""
    from ._version import __version__

    digest = hashlib.sha256(json.dumps([__version__, EXPORT_FORMAT_VERSION, ONNX_GRAPH_REVISION]).encode())
    if (model / MANIFEST).is_file():
        digest.update((model / MANIFEST).read_bytes())
        return digest.hexdigest()
    if not (model / "config.json").is_file():
        raise QuasarError(f"{model}: no config.json (not a Hugging Face checkpoint or a quasar-deploy artifact)")
    digest.update((model / "config.json").read_bytes())
    for file in sorted(model.glob("*.safetensors*")):
        stat = file.stat()
        digest.update(json.dumps([file.name, stat.st_size, stat.st_mtime_ns]).encode())
    return digest.hexdigest()


def head_outside(model: Path) -> bool:
    """Whether ``model``'s cached export leaves its float lm_head to the backend: a W8A8 artifact on a CPU whose float
    dtype is bf16 (its head then runs on torch's bf16 kernel, as on the cpu backend; ORT's CPU kernels have no bf16
    MatMul, and a float32 head would read twice the bytes)."""
    import torch

    from .kernels import default_float_dtype

    return (model / MANIFEST).is_file() and default_float_dtype("cpu") == torch.bfloat16


def onnx_export_path(model: Path) -> Path:
    """Where the ONNX export of ``model`` is cached: its directory name (made safe), its content key and where its head runs."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", model.resolve().name)[:48]
    head = "-head-outside" if head_outside(model) else ""
    return cache_dir() / f"onnx-{name}-{content_key(model)[:16]}{head}"


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
            print(f"quasar-deploy: first use of {model} on ONNX Runtime: exporting it to {path} (once per model)", file=sys.stderr)
            w8a8 = (model / MANIFEST).is_file()
            export(model, "onnx", path, precision="w8a8" if w8a8 else "float", progress=progress, head_outside=head_outside(model))
    return path
