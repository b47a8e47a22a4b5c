"""Exporters: one module per target format, each turning the canonical artifact into what that target runs.

Each target module exposes ``export(files: ModelFiles, output: Path, **options) -> Path``,
writes atomically (temp dir, then rename) and ends with ``write_export_manifest``: the
``quasar-export.json`` that lists every file it wrote with its sha256, which our loaders
verify as they do an artifact's. This package imports nothing heavy, so the CLI can list the
targets without loading torch.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from .._version import __version__
from ..errors import QuasarError
from ..files import require_new
from ..integrity import read_manifest, write_manifest

TARGETS = {"onnx": "quasar_deploy.export.onnx", "npu": "quasar_deploy.export.npu"}
EXPORT_MANIFEST = "quasar-export.json"
EXPORT_FORMAT_VERSION = 1


def write_export_manifest(directory: Path, target: str, source: Path) -> None:
    """The last file an exporter writes: target, provenance, and the sha256 of every other file in ``directory``."""
    record = {"format_version": EXPORT_FORMAT_VERSION, "target": target, "quasar_deploy_version": __version__, "source": str(source)}
    write_manifest(directory, EXPORT_MANIFEST, record)


def read_export_manifest(directory: Path, target: str) -> dict:
    """What a loader of ``target`` exports checks first: the manifest exists, names ``target``, and every file matches it."""
    if not (directory / EXPORT_MANIFEST).is_file():
        raise QuasarError(f"{directory}: no {EXPORT_MANIFEST} (not a complete {target} export of this quasar-deploy); export it again")
    record = read_manifest(directory, EXPORT_MANIFEST, EXPORT_FORMAT_VERSION)
    if record.get("target") != target:
        raise QuasarError(f"{directory / EXPORT_MANIFEST}: a {record.get('target')!r} export, not {target!r}")
    return record


def export(artifact: str | Path, target: str, output: str | Path, **options) -> Path:
    """Export a W8A8 artifact (or, where the target allows ``precision="float"``, a float checkpoint)."""
    from ..artifact import open_model_files

    if target not in TARGETS:
        raise QuasarError(f"unknown export target {target!r}; choose from {', '.join(TARGETS)}")
    output = require_new(output)
    files = open_model_files(artifact)
    module = importlib.import_module(TARGETS[target])
    return module.export(files, output, **options)
