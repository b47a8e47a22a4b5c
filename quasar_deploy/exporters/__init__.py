"""Exporters: one module per target format, each turning the canonical artifact into what that target runs.

Each target module exposes ``export(files: ModelFiles, output: Path, **options) -> Path``,
writes atomically (temp dir, then rename) and ends with ``integrity.write_export_manifest``: the
``quasar-export.json`` that lists every file it wrote with its sha256, which our loaders
verify as they do an artifact's. This package imports nothing heavy, so the CLI can list the
targets without loading torch.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from ..errors import QuasarError
from ..files import require_new

TARGETS = {"onnx": "quasar_deploy.exporters.onnx", "npu": "quasar_deploy.exporters.npu"}
# the forms of an ONNX export's W8A8 linears (onnx_graph.LINEAR_FORMATS builds each): named here, torch- and onnx-free,
# for the CLI's choices and the onnxruntime backend's check of a manifest
ONNX_FORMATS = ("integer", "qdq")
# what the exported graphs hold, for the export cache's key: raised when the same format is encoded anew
# (2: the integer form's weights became int8, which VNNI CPUs multiply natively, unlike the uint8 of revision 1;
# `bench onnx layers` times both forms; 3: graphs declare their IR version, the lowest their opset needs, where they had
# the installed onnx's, which older ONNX Runtime releases refuse: exporters/onnx_versions.py; 4: MatMulInteger states
# its weight zero point, without which ONNX Runtime 1.20-1.21 abort under session.x64quantprecision on AVX2 CPUs)
ONNX_GRAPH_REVISION = 4
# a W8A8 graph may leave its float lm_head outside (the onnxruntime backend computes it in bf16 beside ORT, whose CPU
# kernels have none): the graph then ends in this output, and the head is stored as it was in this file beside it
ONNX_HIDDEN_OUTPUT = "hidden_states"
ONNX_HEAD_FILE = "lm_head.safetensors"


def export(artifact: str | Path, target: str, output: str | Path, **options) -> Path:
    """Export a W8A8 artifact (or, where the target allows ``precision="float"``, a float checkpoint)."""
    from ..artifact import open_model_files

    if target not in TARGETS:
        raise QuasarError(f"unknown export target {target!r}; choose from {', '.join(TARGETS)}")
    output = require_new(output)
    files = open_model_files(artifact)
    module = importlib.import_module(TARGETS[target])
    return module.export(files, output, **options)
