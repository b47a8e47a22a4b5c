"""A W8A8 graph whose float lm_head runs beside ONNX Runtime, on torch's kernel in the CPU's float dtype (bf16 where the
probe picks it: ORT's CPU kernels have no bf16 MatMul): the graph, the head file, the backend, and when "auto" uses it."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

import quasar_deploy  # noqa: E402
from quasar_deploy.artifact import open_model_files  # noqa: E402
from quasar_deploy.backends import onnx_export_cache, registry  # noqa: E402
from quasar_deploy.backends.onnxruntime import load_onnx_export  # noqa: E402
from quasar_deploy.cpu import choice, linears  # noqa: E402
from quasar_deploy.cpu.linears import FloatProbe  # noqa: E402
from quasar_deploy.exporters import ONNX_HEAD_FILE, ONNX_HIDDEN_OUTPUT, export  # noqa: E402
from quasar_deploy.speculative.acceptance import Sampler, SamplingParams  # noqa: E402
from quasar_deploy.speculative.ngram import NgramDrafter  # noqa: E402

from .helpers import (  # noqa: E402
    FAST_CALIBRATION,
    greedy,
    speculate,  # noqa: E402
)
from .helpers import ONNX_PROMPT as PROMPT  # noqa: E402
from .tiny import save_tiny  # noqa: E402

LOGIT_ATOL = 1e-4  # float32 rounding of the same products summed in another order (test_onnx_export)


@pytest.fixture(scope="module")
def bf16_artifact(tmp_path_factory):
    """A tied bf16 checkpoint's artifact: its table is the head, stored bf16."""
    root = tmp_path_factory.mktemp("bf16")
    source = save_tiny(root / "model", "qwen3", seed=3, dtype=torch.bfloat16, tie_word_embeddings=True)
    return quasar_deploy.calibrate(source, output=root / "w8a8", **FAST_CALIBRATION).path


@pytest.fixture(scope="module")
def exports(tiny_artifact, tmp_path_factory):
    root = tmp_path_factory.mktemp("head")
    inside = export(tiny_artifact.path, "onnx", root / "inside", progress=False)
    outside = export(tiny_artifact.path, "onnx", root / "outside", progress=False, head_outside=True)
    return inside, outside


def test_the_graph_ends_in_hidden_states_and_the_head_is_stored_beside_it(exports):
    inside, outside = exports
    graph = onnx.load(outside / "model.onnx", load_external_data=False)
    assert [o.name for o in graph.graph.output][0] == ONNX_HIDDEN_OUTPUT
    assert not any(i.name.startswith("lm_head") for i in graph.graph.initializer)
    record = json.loads((outside / "quasar-export.json").read_text())
    assert record["head"] == "outside" and ONNX_HEAD_FILE in record["files"]
    assert "head" not in json.loads((inside / "quasar-export.json").read_text())


def test_logits_equal_the_in_graph_head_to_float_rounding(exports):
    """float32 here (the suite's dtype): the same head on torch's kernel instead of ORT's, the same numbers."""
    inside, outside = (load_onnx_export(path, threads=1) for path in exports)
    assert "float32 lm_head on torch" in outside.description
    assert (outside.verify(PROMPT) - inside.verify(PROMPT)).abs().max() < LOGIT_ATOL
    assert torch.equal(outside.prefill(PROMPT).argmax(), inside.prefill(PROMPT).argmax())


def test_speculative_output_is_the_backends_own_greedy_decode(exports):
    lm = load_onnx_export(exports[1], threads=1)
    expected = greedy(lm, PROMPT, 24)
    for k in (1, 4):
        steps = speculate(lm, NgramDrafter(), PROMPT, Sampler(SamplingParams()), k, 24)
        assert [t for step in steps for t in step] == expected


def test_a_bf16_table_stays_bf16_in_the_graph(bf16_artifact, tmp_path):
    out = export(bf16_artifact, "onnx", tmp_path / "onnx", progress=False, head_outside=True)
    graph = onnx.load(out / "model.onnx")
    table = next(i for i in graph.graph.initializer if i.name == "model.embed_tokens.weight")
    assert table.data_type == onnx.TensorProto.BFLOAT16
    from safetensors.torch import load_file

    head = load_file(out / ONNX_HEAD_FILE)["weight"]
    stored = load_file(bf16_artifact / "model.safetensors")["model.embed_tokens.weight"]
    assert head.dtype == torch.bfloat16 and torch.equal(head, stored)
    rows = onnx.numpy_helper.to_array(table)[[5, 9]].astype(np.float32)
    assert np.array_equal(rows, stored[[5, 9]].float().numpy())
    lm = load_onnx_export(out, threads=1)
    inside = load_onnx_export(export(bf16_artifact, "onnx", tmp_path / "in", progress=False), threads=1)
    assert greedy(lm, PROMPT, 8) == greedy(inside, PROMPT, 8)


def test_an_int8_head_stays_in_the_graph(tiny_int8_head_artifact, tmp_path):
    out = export(tiny_int8_head_artifact.path, "onnx", tmp_path / "onnx", progress=False, head_outside=True)
    assert "head" not in json.loads((out / "quasar-export.json").read_text()) and not (out / ONNX_HEAD_FILE).exists()


def test_auto_leaves_the_head_outside_where_the_cpu_computes_bf16(tiny_artifact, tiny_qwen3, monkeypatch):
    monkeypatch.delenv(linears.FLOAT_DTYPE_ENV, raising=False)
    monkeypatch.setattr(linears, "float_probe", lambda: FloatProbe(4.0, 1.5, 256))  # a bf16 CPU
    monkeypatch.setattr(choice, "default_int8_kernel", lambda device="cpu": "onednn-vnni")  # whose int8 probe picks a library kernel
    assert onnx_export_cache.head_outside(tiny_artifact.path) and not onnx_export_cache.head_outside(tiny_qwen3)
    outside = onnx_export_cache.onnx_export_path(tiny_artifact.path)
    assert registry.auto_backend(open_model_files(tiny_qwen3)) == "cpu"  # a float checkpoint: bf16 on torch beats float32 on ORT
    assert registry.auto_backend(tiny_artifact) == "onnxruntime"
    monkeypatch.setattr(linears, "float_probe", lambda: FloatProbe(4.0, 20.0, 256))  # bf16 emulated
    assert not onnx_export_cache.head_outside(tiny_artifact.path) and onnx_export_cache.onnx_export_path(tiny_artifact.path) != outside
    assert registry.auto_backend(open_model_files(tiny_qwen3)) == "onnxruntime"
