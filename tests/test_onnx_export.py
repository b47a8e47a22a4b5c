"""ONNX export: the W8A8 linear is bit-exact to the scheme, whole graphs pass the checker and match the torch decoder."""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from onnx import TensorProto, helper  # noqa: E402

import quasar_deploy  # noqa: E402
from quasar_deploy import demo_model_path  # noqa: E402
from quasar_deploy.artifact import open_model_files  # noqa: E402
from quasar_deploy.backends.torch_backend import load_cpu  # noqa: E402
from quasar_deploy.errors import QuasarError  # noqa: E402
from quasar_deploy.exporters import export  # noqa: E402
from quasar_deploy.exporters import onnx as onnx_export  # noqa: E402
from quasar_deploy.exporters.onnx_graph import GraphBuilder, w8a8_linear  # noqa: E402
from quasar_deploy.files import sha256_files  # noqa: E402
from quasar_deploy.scheme import quantize_weight, reference_linear  # noqa: E402

from .helpers import ONNX_PROMPT as PROMPT  # noqa: E402
from .helpers import ort_session as session  # noqa: E402
from .helpers import run_full  # noqa: E402
from .tiny import save_tiny  # noqa: E402

# Only float ops outside the linears (norms, softmax, rotary) differ from torch, by float32 rounding.
LOGIT_ATOL = 1e-4


@pytest.mark.parametrize("static", [False, True])
def test_linear_is_bit_exact_to_the_scheme(static):
    torch.manual_seed(0)
    k, n = 512, 48
    wq, w_scale = quantize_weight(torch.randn(n, k))
    x = torch.randn(6, k)
    x[:, :8] *= 40  # outlier channels push other values to small codes; full-range codes overflow AVX2 u8 x s8 kernels
    x[3] = 0  # an all-zero row takes the clamped scale
    input_scale = torch.tensor([x.abs().max().item() / 127 * 0.5]) if static else None  # static: half the rows saturate
    g = GraphBuilder()
    y = w8a8_linear(g, "x", wq.numpy(), w_scale.numpy(), None if input_scale is None else float(input_scale), "test")
    g.op("Identity", y, outputs=["y"])
    io = [helper.make_tensor_value_info(name, TensorProto.FLOAT, ["m", size]) for name, size in (("x", k), ("y", n))]
    model = g.model("linear", io[:1], io[1:])
    onnx.checker.check_model(model)
    got = session(model).run(None, {"x": x.numpy()})[0]
    expected = reference_linear(x, wq, w_scale, input_scale=input_scale)
    assert torch.equal(torch.from_numpy(got), expected)


@pytest.fixture(scope="module")
def exported(tiny_qwen3, tiny_artifact, tiny_static_artifact, tiny_onnx, tmp_path_factory):
    """(source, export directory) by kind; the dynamic W8A8 export is the shared one, the others are this module's."""
    root = tmp_path_factory.mktemp("onnx")
    return {
        "dynamic": (tiny_artifact.path, tiny_onnx),
        "static": (tiny_static_artifact.path, export(tiny_static_artifact.path, "onnx", root / "static-onnx")),
        "float": (tiny_qwen3, export(tiny_qwen3, "onnx", root / "float-onnx", precision="float")),
    }


@pytest.mark.parametrize("kind", ["dynamic", "static", "float"])
def test_graph_is_checker_clean_and_matches_torch(exported, kind, tmp_path):
    source, out = exported[kind]
    onnx.checker.check_model(str(out / "model.onnx"), full_check=True)
    assert {p.name for p in out.iterdir()} >= {"model.onnx", "genai_config.json", "config.json", "tokenizer.json"}
    files = open_model_files(source)
    sess = session(out / "model.onnx", optimized=tmp_path / "optimized.onnx")
    got = torch.from_numpy(run_full(sess, files.spec, PROMPT))
    expected = load_cpu(open_model_files(source), int8_kernel="reference").verify(PROMPT)
    assert (got - expected).abs().max().item() < LOGIT_ATOL
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
    ops = collections.Counter(node.op_type for node in onnx.load(str(tmp_path / "optimized.onnx")).graph.node)
    products = 4 * files.spec.num_layers  # q/k/v and gate/up read one input, quantized alike: one product each
    if kind == "float":
        assert "MatMulInteger" not in ops
        assert ops["MatMul"] + ops["FusedMatMul"] == products + 2 * files.spec.num_layers + 1  # + attention's two, the head
    else:  # every quantized linear stays an integer kernel after ORT's optimizations
        assert ops["MatMulInteger"] == products
        assert "DequantizeLinear" not in ops


def test_batch_axis_is_dynamic(exported):
    """Two different sequences in one call give each one's own logits (per-token scales are per row)."""
    source, out = exported["dynamic"]
    spec, sess = open_model_files(source).spec, session(out / "model.onnx")
    other = [7, 7, 3000, 2, 5, 100, 8, 9, 10]
    n = len(PROMPT)
    feed = {
        "input_ids": np.array([PROMPT, other]),
        "position_ids": np.tile(np.arange(n), (2, 1)),
        "attention_mask": np.ones((2, n), np.int64),
    }
    empty = np.zeros((2, spec.num_kv_heads, 0, spec.head_dim), np.float32)
    feed.update({f"past_key_values.{i}.{kv}": empty for i in range(spec.num_layers) for kv in ("key", "value")})
    both = sess.run(["logits"], feed)[0]
    for row, ids in enumerate((PROMPT, other)):
        np.testing.assert_allclose(both[row], run_full(sess, spec, ids), atol=LOGIT_ATOL)


def test_sidecar_describes_the_graph(exported):
    import json

    config = json.loads((exported["static"][1] / "genai_config.json").read_text())
    decoder = config["model"]["decoder"]
    assert decoder["inputs"]["past_key_names"] % 2 == "past_key_values.2.key"
    assert decoder["outputs"]["present_value_names"] % 0 == "present.0.value"
    assert config["quasar"]["precision"] == "w8a8" and config["quasar"]["activation"] == "static"
    assert config["quasar"]["source_manifest_sha256"] == sha256_files(open_model_files(exported["static"][0]).path / "quasar.json")
    graph = onnx.load(str(exported["static"][1] / "model.onnx"), load_external_data=False).graph
    dims = [d.dim_param or d.dim_value for d in graph.input[3].type.tensor_type.shape.dim]
    assert graph.input[3].name == "past_key_values.0.key" and dims == ["batch_size", 2, "past_sequence_length", 128]


def test_large_models_use_external_data(exported, tmp_path, monkeypatch):
    monkeypatch.setattr(onnx_export, "EXTERNAL_DATA_THRESHOLD", 0)
    source, small = exported["dynamic"]
    out = export(source, "onnx", tmp_path / "external")
    assert (out / "model.onnx.data").stat().st_size > 10 * (out / "model.onnx").stat().st_size
    spec = open_model_files(source).spec
    np.testing.assert_array_equal(
        run_full(session(out / "model.onnx"), spec, PROMPT), run_full(session(small / "model.onnx"), spec, PROMPT)
    )


# A rounding boundary is where x / scale sits half-way between two codes. Float parts computed by another library
# (ORT's fused norm, its attention GEMMs) differ from torch's by float32 rounding: a relative 1e-6 or so of values up
# to 127 codes, 1e-4 of a code. Only activations this close to a boundary may take the neighbouring code.
BOUNDARY_CODES = 1e-3


def _codes_exposed(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[str]]:
    """``model`` with every activation-quantizing ``QuantizeLinear``'s output (uint8 codes, zero point 128) made a graph
    output too, in the order the graph quantizes them: each layer's q/k/v, o_proj, gate/up, down_proj."""
    names = [node.output[0] for node in model.graph.node if node.op_type == "QuantizeLinear"]
    for name in names:
        model.graph.output.append(helper.make_tensor_value_info(name, TensorProto.UINT8, None))
    return model, names


@pytest.mark.slow
def test_demo_model_w8a8_graph_is_torchs_on_the_same_codes(tmp_path, monkeypatch):
    """The contract on every CPU (docs/architecture.md, "Numerics across backends"): ORT's integer graph quantizes each
    activation to torch's code, except where the value lies within float rounding of a rounding boundary (there the
    neighbouring code, one step away); and given ORT's own codes, torch's reference computes ORT's logits to float
    rounding (the integer products are exact on both). So where the two backends' logits drift apart, it is by code
    flips at boundaries, which no fusion setting can remove: each library rounds its float parts its own way."""
    artifact = quasar_deploy.calibrate(demo_model_path(), output=tmp_path / "demo", num_samples=8, seq_len=64, progress=False).path
    out = export(artifact, "onnx", tmp_path / "demo-onnx")
    spec = open_model_files(artifact).spec
    ids = list(range(3, 60, 3))
    model, names = _codes_exposed(onnx.load(out / "model.onnx"))
    feed = {"input_ids": np.array([ids]), "position_ids": np.arange(len(ids))[None], "attention_mask": np.ones((1, len(ids)), np.int64)}
    for i in range(spec.num_layers):
        for name in (f"past_key_values.{i}.key", f"past_key_values.{i}.value"):
            feed[name] = np.zeros((1, spec.num_kv_heads, 0, spec.head_dim), np.float32)
    ort_logits, *ort_codes = session(model).run(["logits", *names], feed)
    ort_codes = [torch.from_numpy(c.astype(np.float32) - 128).reshape(-1, c.shape[-1]) for c in ort_codes]

    from quasar_deploy.cpu import linears

    own = linears.quantize_activation
    flips = []

    def ort_code(x, scale):
        """torch's own code for x, checked against ORT's; ORT's is what the linear then multiplies."""
        expected, theirs = own(x, scale), ort_codes[len(flips)]
        differ = expected != theirs
        distance = ((x.float() / scale).abs().frac() - 0.5).abs()
        assert torch.all((expected - theirs).abs()[differ] == 1) and torch.all(distance[differ] < BOUNDARY_CODES)
        flips.append(int(differ.sum()))
        return theirs

    monkeypatch.setattr(linears, "quantize_activation", ort_code)
    fed = load_cpu(open_model_files(artifact), int8_kernel="reference").verify(ids)
    assert len(flips) == len(ort_codes) == 4 * spec.num_layers
    assert (torch.from_numpy(ort_logits[0]) - fed).abs().max() < LOGIT_ATOL


@pytest.mark.slow
def test_demo_model_float_graph_matches_torch(tmp_path):
    """Without int8 codes there is nothing to flip: the float graph equals torch's float decoder to float rounding."""
    out = export(demo_model_path(), "onnx", tmp_path / "demo-onnx", precision="float")
    ids = list(range(3, 60, 3))
    got = torch.from_numpy(run_full(session(out / "model.onnx"), open_model_files(demo_model_path()).spec, ids))
    assert (got - load_cpu(open_model_files(demo_model_path())).verify(ids)).abs().max() < LOGIT_ATOL


@pytest.mark.parametrize(
    ("arch", "overrides"),
    [("llama", {}), ("qwen2", {}), ("mistral", {"sliding_window": 4})],
    ids=["llama", "qwen2-bias", "mistral-window"],
)
def test_other_families_match_torch(tmp_path, arch, overrides):
    """No QK-norm (Llama), q/k/v biases (Qwen2), a sliding window shorter than the prompt (Mistral)."""
    source = save_tiny(tmp_path / arch, arch, num_hidden_layers=2, **overrides)
    spec = open_model_files(source).spec
    assert spec.sliding_window == overrides.get("sliding_window", spec.sliding_window)
    got = torch.from_numpy(run_full(session(export(source, "onnx", tmp_path / "onnx", precision="float") / "model.onnx"), spec, PROMPT))
    expected = load_cpu(open_model_files(source)).verify(PROMPT)
    assert (got - expected).abs().max().item() < LOGIT_ATOL


@pytest.mark.parametrize(
    ("kind", "precision", "message"),
    [("float", "w8a8", "calibrate it first"), ("dynamic", "float", "holds no float weights"), ("dynamic", "int4", "unknown precision")],
)
def test_wrong_precision_is_one_line_error(exported, tmp_path, kind, precision, message):
    with pytest.raises(QuasarError, match=message) as info:
        export(exported[kind][0], "onnx", tmp_path / "out", precision=precision)
    assert "\n" not in str(info.value)
    assert not (tmp_path / "out").exists() and not list(tmp_path.iterdir())


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_streamed_export_equals_the_in_memory_graph(tmp_path, tied):
    """Layer by layer into ``model.onnx.data`` (a bf16 sharded source, embeddings and lm_head block by block) gives the
    very initializers and nodes of the graph built from the whole decoder in memory."""
    from onnx import numpy_helper

    from .helpers import decoder_graph

    source = save_tiny(tmp_path / "src", dtype=torch.bfloat16, max_shard_size=200_000, tie_word_embeddings=tied)
    artifact = quasar_deploy.calibrate(source, tmp_path / "w8a8", progress=False, num_samples=4, seq_len=32).path
    out = export(artifact, "onnx", tmp_path / "onnx", external=True, progress=False)
    streamed = onnx.load(str(out / "model.onnx"))
    in_memory = decoder_graph(open_model_files(artifact).decoder(), streamed.graph.name)
    assert [n.op_type for n in streamed.graph.node] == [n.op_type for n in in_memory.graph.node]
    expected = {t.name: numpy_helper.to_array(t) for t in in_memory.graph.initializer}
    got = {t.name: numpy_helper.to_array(t) for t in streamed.graph.initializer}
    assert got.keys() == expected.keys()
    for name, array in expected.items():
        np.testing.assert_array_equal(got[name], array, err_msg=name)
