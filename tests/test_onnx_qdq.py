"""The QDQ ONNX export (``--format qdq``): what ORT's CPU provider makes of it, how close it is to the scheme, and the
provider choices of the onnxruntime backend that it is meant for."""

from __future__ import annotations

import collections
import json

import pytest
import torch

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from onnx import TensorProto, helper  # noqa: E402

from quasar_deploy.backends.onnxruntime import load_onnx_export, mismatch_note  # noqa: E402
from quasar_deploy.backends.torch_backend import load_cpu  # noqa: E402
from quasar_deploy.errors import QuasarError  # noqa: E402
from quasar_deploy.exporters import ONNX_FORMATS, export  # noqa: E402
from quasar_deploy.exporters.onnx_graph import LINEAR_FORMATS, GraphBuilder, qdq_linear  # noqa: E402
from quasar_deploy.integrity import EXPORT_MANIFEST  # noqa: E402
from quasar_deploy.scheme import quantize_weight, reference_linear  # noqa: E402

from .helpers import ONNX_PROMPT as PROMPT  # noqa: E402
from .helpers import assert_one_line_error, copy_dir, reseal, run_full  # noqa: E402
from .helpers import ort_session as session  # noqa: E402

# ORT's CPU provider runs each Q/DQ linear as MatMulIntegerToFloat: exact integer accumulation, then
# acc * (act_scale * weight_scale) where the scheme computes (acc * act_scale) * weight_scale: a few float32 ulps apart.
EPILOGUE_RTOL = 1e-6
# Whole graph against the torch decoder: the same bound as the integer graph (docs/onnx.md, Fidelity); measured 2.4e-7.
LOGIT_ATOL = 1e-4


@pytest.fixture(scope="module")
def qdq_onnx(tiny_static_artifact, tmp_path_factory):
    return export(tiny_static_artifact.path, "onnx", tmp_path_factory.mktemp("qdq") / "onnx", linear_format="qdq")


def test_format_names_match_the_graph_builders():
    assert tuple(LINEAR_FORMATS) == ONNX_FORMATS


def test_linear_fuses_to_an_integer_kernel_and_matches_the_scheme(tmp_path):
    torch.manual_seed(0)
    k, n = 512, 48
    wq, w_scale = quantize_weight(torch.randn(n, k))
    x = torch.randn(6, k)
    x[:, :8] *= 40  # outlier channels: full-range codes
    x[3] = 0
    input_scale = torch.tensor([x.abs().max().item() / 127 * 0.5])  # half the outliers saturate, on both sides
    g = GraphBuilder("qdq")
    g.op("Identity", qdq_linear(g, "x", wq.numpy(), w_scale.numpy(), float(input_scale), "test"), outputs=["y"])
    io = [helper.make_tensor_value_info(name, TensorProto.FLOAT, ["m", size]) for name, size in (("x", k), ("y", n))]
    model = g.model("linear", io[:1], io[1:])
    onnx.checker.check_model(model, full_check=True)
    got = torch.from_numpy(session(model, optimized=tmp_path / "optimized.onnx").run(None, {"x": x.numpy()})[0])
    expected = reference_linear(x, wq, w_scale, input_scale=input_scale)
    # one activation code off (e.g. QuantizeLinear's -128 where the scheme saturates at -127) moves an output by > 1e-3 relative
    torch.testing.assert_close(got, expected, rtol=EPILOGUE_RTOL, atol=0)
    ops = [node.op_type for node in onnx.load(str(tmp_path / "optimized.onnx")).graph.node]
    assert "MatMulIntegerToFloat" in ops and "MatMul" not in ops and "DequantizeLinear" not in ops


def test_graph_is_checker_clean_and_matches_torch(tiny_static_artifact, qdq_onnx, tmp_path):
    onnx.checker.check_model(str(qdq_onnx / "model.onnx"), full_check=True)
    graph = onnx.load(str(qdq_onnx / "model.onnx")).graph
    spec = tiny_static_artifact.spec
    ops = collections.Counter(node.op_type for node in graph.node)
    linears = 7 * spec.num_layers
    assert ops["QuantizeLinear"] == linears and ops["DequantizeLinear"] == 2 * linears and "MatMulInteger" not in ops
    initializers = {t.name: t for t in graph.initializer}
    weight = initializers["model.layers.0.mlp.down_proj.weight_int8"]
    assert weight.data_type == TensorProto.INT8 and list(weight.dims) == [spec.intermediate_size, spec.hidden_size]
    assert list(initializers["model.layers.0.mlp.down_proj.input_scale"].dims) == []  # per-tensor: a scalar, not [1]
    got = torch.from_numpy(run_full(session(qdq_onnx / "model.onnx", optimized=tmp_path / "optimized.onnx"), spec, PROMPT))
    expected = load_cpu(tiny_static_artifact, int8_kernel="reference").verify(PROMPT)
    assert (got - expected).abs().max().item() < LOGIT_ATOL
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
    optimized = collections.Counter(node.op_type for node in onnx.load(str(tmp_path / "optimized.onnx")).graph.node)
    assert optimized["MatMulIntegerToFloat"] == linears and "DequantizeLinear" not in optimized  # every linear fused


def test_manifest_and_sidecar_record_the_format(qdq_onnx, tiny_onnx):
    record = json.loads((qdq_onnx / EXPORT_MANIFEST).read_text())
    assert record["linear_format"] == "qdq" and record["precision"] == "w8a8"
    assert "QuantizeLinear" in json.loads((qdq_onnx / "genai_config.json").read_text())["quasar"]["linear"]
    assert json.loads((tiny_onnx / EXPORT_MANIFEST).read_text())["linear_format"] == "integer"
    lm = load_onnx_export(qdq_onnx, threads=1)
    assert lm.linear_format == "qdq" and lm.description.startswith("onnxruntime CPUExecutionProvider (W8A8 qdq graph), ")
    assert load_onnx_export(tiny_onnx, threads=1).linear_format == "integer"


def test_a_manifest_format_that_does_not_fit_the_graph_is_refused(qdq_onnx, tmp_path):
    copy = copy_dir(qdq_onnx, tmp_path)
    record = json.loads((copy / EXPORT_MANIFEST).read_text())
    (copy / EXPORT_MANIFEST).write_text(json.dumps({**record, "linear_format": "int4"}))
    reseal(copy, EXPORT_MANIFEST)
    with pytest.raises(QuasarError, match="linear_format 'int4' does not fit a W8A8 graph") as info:
        load_onnx_export(copy, threads=1)
    assert "\n" not in str(info.value)


def test_greedy_ngram_equals_its_own_autoregressive_decode(qdq_onnx):
    from quasar_deploy.api import load

    engine = load(qdq_onnx, backend="onnxruntime", threads=1)
    prompt = "the cat sat on the mat. the cat sat on the"
    speculative = engine.generate(prompt, max_new_tokens=24, draft="ngram")
    plain = engine.generate(prompt, max_new_tokens=24, draft="none")
    assert speculative.tokens == plain.tokens and len(plain.tokens) == 24
    assert speculative.stats.loop.accepted > 0  # some verify steps took drafted blocks (k+1 rows), not one token


@pytest.mark.parametrize(
    ("kind", "precision", "message"),
    [("dynamic", "w8a8", "--activation static"), ("float", "float", "a float graph has no quantized linears")],
)
def test_what_has_no_qdq_form_is_refused_in_one_line(tiny_artifact, tiny_qwen3, tmp_path, kind, precision, message):
    source = tiny_artifact.path if kind == "dynamic" else tiny_qwen3
    with pytest.raises(QuasarError, match=message) as info:
        export(source, "onnx", tmp_path / "out", precision=precision, linear_format="qdq")
    assert "\n" not in str(info.value) and not list(tmp_path.iterdir())


def test_cli_export_format(tiny_static_artifact, tiny_artifact, tmp_path):
    from click.testing import CliRunner

    from quasar_deploy.cli import main

    run = CliRunner().invoke
    result = run(main, ["export", str(tiny_static_artifact.path), "--target", "onnx", "--format", "qdq", "-o", str(tmp_path / "q")])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "q" / EXPORT_MANIFEST).read_text())["linear_format"] == "qdq"
    assert_one_line_error(
        run(main, ["export", str(tiny_artifact.path), "--target", "onnx", "--format", "qdq", "-o", str(tmp_path / "d")]),
        "--activation static",
    )
    assert_one_line_error(
        run(main, ["export", str(tiny_artifact.path), "--target", "npu", "--format", "qdq", "-o", str(tmp_path / "n")]),
        "--target onnx only",
    )


@pytest.mark.parametrize(("provider", "missing"), [("cuda", "CUDAExecutionProvider"), ("tensorrt", "TensorrtExecutionProvider")])
def test_absent_gpu_provider_is_refused_naming_onnxruntime_gpu(qdq_onnx, provider, missing):
    if missing in ort.get_available_providers():
        pytest.skip(f"this onnxruntime has {missing}")
    with pytest.raises(QuasarError, match=f"{missing} is not available.*onnxruntime-gpu") as info:
        load_onnx_export(qdq_onnx, provider=provider, threads=1)
    assert "\n" not in str(info.value)


def test_a_provider_that_falls_back_is_refused(qdq_onnx, monkeypatch):
    """ORT's Python API replaces a provider that does not start by the next one in the list; we refuse instead."""
    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this onnxruntime has CUDA: it would start")
    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    with pytest.raises(QuasarError, match="CUDAExecutionProvider did not start.*fell back to CPUExecutionProvider"):
        load_onnx_export(qdq_onnx, provider="cuda", threads=1)


def test_tensorrt_profile_spans_every_cache_length(qdq_onnx):
    """One optimization profile from an empty cache to the context window (512 tokens for the tiny model): TensorRT
    never has to rebuild its engine while a sequence grows. Not run here (no GPU); this checks what ORT is given."""
    from quasar_deploy.backends.onnxruntime import read_config, tensorrt_options

    options = tensorrt_options(read_config(qdq_onnx)[0])
    assert options["trt_int8_enable"] is True
    profiles = {
        k.removeprefix("trt_profile_").removesuffix("_shapes"): dict(p.split(":") for p in v.split(","))
        for k, v in options.items()
        if "profile" in k
    }
    assert profiles["min"]["past_key_values.0.key"] == "1x2x0x128" and profiles["min"]["input_ids"] == "1x1"
    assert (
        profiles["opt"]["input_ids"] == "1x6"
        and profiles["opt"]["attention_mask"] == "1x512"
        and profiles["opt"]["past_key_values.2.value"] == "1x2x506x128"
    )
    assert profiles["max"]["input_ids"] == "1x512" and profiles["max"]["past_key_values.2.value"] == "1x2x512x128"
    assert all(len(profile) == 3 + 2 * 3 for profile in profiles.values())


def test_mismatch_notes():
    assert mismatch_note("CPUExecutionProvider", "integer") is None and mismatch_note("CUDAExecutionProvider", None) is None
    assert mismatch_note("TensorrtExecutionProvider", "qdq") is None
    assert "on the CPU" in mismatch_note("CUDAExecutionProvider", "integer")
    assert "on the CPU" in mismatch_note("TensorrtExecutionProvider", "integer")
    assert "float math" in mismatch_note("CUDAExecutionProvider", "qdq")


def test_provider_names_match_the_backend():
    from quasar_deploy.backends.onnxruntime import PROVIDERS
    from quasar_deploy.cli.options import ONNX_PROVIDERS

    assert ONNX_PROVIDERS == ("auto", *PROVIDERS)


def test_cli_provider_option(qdq_onnx, tiny_static_artifact):
    from click.testing import CliRunner

    from quasar_deploy.cli import main

    run = CliRunner().invoke
    args = ["--prompt", "the cat", "--max-new-tokens", "3", "--json"]
    result = run(main, ["generate", str(qdq_onnx), "--provider", "cpu", *args])
    assert result.exit_code == 0, result.output
    assert len(json.loads(result.output.splitlines()[-1])["tokens"]) == 3
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        assert_one_line_error(run(main, ["generate", str(qdq_onnx), "--provider", "cuda", *args]), "onnxruntime-gpu")
    # an artifact runs on ONNX Runtime through its cached export ("auto"), so the provider applies
    result = run(main, ["generate", str(tiny_static_artifact.path), "--provider", "cpu", *args])
    assert result.exit_code == 0, result.output
    generated = json.loads(result.stdout)  # stderr has the export's progress
    assert generated["backend"].startswith("onnxruntime CPUExecutionProvider (W8A8 ") and len(generated["tokens"]) == 3
    assert_one_line_error(run(main, ["serve", str(tiny_static_artifact.path), "--backend", "cpu", "--provider", "cpu"]), "not cpu")
