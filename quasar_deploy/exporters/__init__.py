"""Exporters: one module per target format, each turning the canonical artifact into what that target runs.

Each target module has ``export(files, output, **options) -> Path``, writes atomically and ends with
``integrity.write_export_manifest``. Nothing heavy is imported here, so the CLI lists targets without torch."""

from __future__ import annotations

import importlib
from pathlib import Path

from ..errors import QuasarError
from ..files import require_new

TARGETS = {"onnx": "quasar_deploy.exporters.onnx", "npu": "quasar_deploy.exporters.npu"}
# the forms of an ONNX export's W8A8 linears (onnx_graph.LINEAR_FORMATS), named torch- and onnx-free for the CLI
ONNX_FORMATS = ("integer", "qdq")
# the export cache's key: raised whenever the graphs are encoded anew (4: MatMulInteger states its weight zero point)
ONNX_GRAPH_REVISION = 4
# a W8A8 graph whose float lm_head is computed beside ORT ends in this output; the head is stored in this file beside it
ONNX_HIDDEN_OUTPUT = "hidden_states"
ONNX_HEAD_FILE = "lm_head.safetensors"


def export(artifact: str | Path, target: str, output: str | Path, **options) -> Path:
    """Export a W8A8 artifact (or, where the target allows ``precision="float"``, a float checkpoint)."""
    from ..artifact import open_model_files  # keeps --help torch-free

    if target not in TARGETS:
        raise QuasarError(f"unknown export target {target!r}; choose from {', '.join(TARGETS)}")
    output = require_new(output)
    files = open_model_files(artifact)
    return importlib.import_module(TARGETS[target]).export(files, output, **options)
