"""The ONNX export the onnxruntime backend runs when it is handed an artifact or a checkpoint instead of an export:
exported on first use into the cache, keyed by its source's content alone (an artifact's ``quasar.json``, or a float
checkpoint's file hashes, computed once per file version).
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import sys
from pathlib import Path

import torch

from .._version import __version__
from ..artifact import ModelFiles
from ..cache import INDEX, cache_dir, locked, make_room, read_json, used, write_json
from ..checkpoint import Checkpoint
from ..cpu.linears import head_beside_graph
from ..errors import QuasarError
from ..exporters import ONNX_GRAPH_REVISION, export
from ..files import TOKENIZER_FILES, sha256_files
from ..integrity import EXPORT_FORMAT_VERSION, MANIFEST
from ..memory import EMBEDDINGS, estimate, head_dtype_name
from ..shards import TORCH_DTYPES

HASHES = "hashes.json"


def _file_sha256(file: Path, known: dict) -> str:
    """sha256 of ``file``, from ``known`` while the file is the same version (size, mtime, inode), else read and added."""
    stat = file.stat()
    version = [stat.st_size, stat.st_mtime_ns, stat.st_ino]
    entry = known.get(str(file.resolve()))
    if entry is None or entry[:3] != version:
        entry = known[str(file.resolve())] = [*version, sha256_files(file)]
    return entry[3]


def content_key(model: Path) -> str:
    """sha256 naming what ``model`` holds: its artifact record, or the sha256 of each checkpoint file an export reads."""
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
    """Whether ``model``'s cached export leaves its float lm_head to torch (a W8A8 artifact: ``head_beside_graph``)."""
    if not (model / MANIFEST).is_file():
        return False
    return head_beside_graph(TORCH_DTYPES[head_dtype_name(Checkpoint(model).dtypes)])


def onnx_export_path(model: Path) -> Path:
    """Where the ONNX export of ``model`` is cached: named by its content key and where its head runs (``head_outside``)."""
    return cache_dir() / f"onnx-{content_key(model)[:24]}{'-head-outside' if head_outside(model) else ''}"


def export_bytes(files: ModelFiles) -> int:
    """About what the ONNX export of ``files`` takes on disk: int8 linears with their scales, everything else float32."""
    needed = estimate(files, float_dtype=torch.float32)  # the graph's float weights are float32
    return needed.int8_weights + needed.float_weights + 4 * math.prod(files.checkpoint.shapes[EMBEDDINGS])


def cached_onnx_export(files: ModelFiles, replace: bool = False, progress: bool = True) -> Path:
    """The ONNX export of the opened artifact or checkpoint ``files``, made on first use; ``replace``: made again (damaged)."""
    model = files.path
    path = onnx_export_path(model)
    with locked(path):
        if replace and path.exists():
            shutil.rmtree(path)
        if not path.exists():
            make_room(export_bytes(files), keep=(model.resolve(),))  # the source may be in the cache too (the demo's)
            print(f"quasar-deploy: first use of {model} on ONNX Runtime: exporting it to {path} (once per model)", file=sys.stderr)
            precision = "w8a8" if files.is_artifact else "float"
            export(model, "onnx", path, precision=precision, progress=progress, head_outside=head_outside(model))
        used(path, model)
    return path
