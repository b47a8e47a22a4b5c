"""Every kind of ONNX model we write loads and runs on each ONNX Runtime release the project pins, with the outputs of
the suite's own: the images' (docker/*/constraints.txt; onnxruntime-gpu's through its CPU build) and the ``onnx``
extra's floor, as tools/onnxruntimes.py reads them from those files. A pin bump that an export does not load on (an
IR version or opset too new for it) fails here, not in a container.

Each release runs in a child process (tests/ort_runner.py); one other than the suite's own is imported from the folder
``tools/onnxruntimes.py install DIR`` put it in ($QUASAR_ONNXRUNTIMES, default .onnxruntimes/ at the repository
root), which .ci/run fills. Where it is missing the test fails under CI=true and is skipped elsewhere, saying how to
install it. The models: the three graph forms of ``export --target onnx`` (integer, qdq, float), the graph whose head
is outside and the one with an int8 head, the batched backend's layer graphs, and the int8 probe every session runs.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from onnx import helper  # noqa: E402
from packaging.version import Version  # noqa: E402

from quasar_deploy.backends.ort_session import PRECISE_INT8_OPTION, bit_exact_int8_entries, int8_probe  # noqa: E402
from quasar_deploy.exporters import export, onnx_layers  # noqa: E402
from quasar_deploy.exporters.onnx_versions import IR_VERSIONS, OPSETS  # noqa: E402
from quasar_deploy.model import DecoderLayer, RMSNorm, load_linear, tensor_loader  # noqa: E402

from . import ort_runner  # noqa: E402
from .helpers import ONNX_PROMPT, prefill_feed  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RUNNER = Path(ort_runner.__file__)
_spec = importlib.util.spec_from_file_location("onnxruntimes", ROOT / "tools" / "onnxruntimes.py")
onnxruntimes = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(onnxruntimes)
RELEASES = onnxruntimes.pinned()
RUNTIMES = Path(os.environ.get("QUASAR_ONNXRUNTIMES", ROOT / ".onnxruntimes"))
# Float outputs: the same graph on two releases of ORT's CPU kernels, which may fuse and order float sums differently
# (the int8 products are exact on both); the probe's int32 outputs must be equal.
RTOL, ATOL = 1e-4, 1e-4


def _layer_graphs(files, rows: int) -> dict[str, tuple[bytes, dict[str, np.ndarray]]]:
    """The batched backend's graphs of ``files`` (layer 0's two, the final norm, attention, the int8 head where there is
    one), each with a feed of ``rows`` random rows; attention writes 3 new rows after 2 cached ones."""
    spec, rng = files.spec, np.random.default_rng(0)
    load = tensor_loader(files.checkpoint, torch.float32)
    layer = DecoderLayer(spec, load, spec.layer_prefix(0))
    heads, kv, dim = spec.num_heads, spec.num_kv_heads, spec.head_dim

    def rand(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    x = rand(rows, spec.hidden_size)
    cache = np.zeros((1, kv, 8, dim), np.float32)
    cache[:, :, :2] = rand(1, kv, 2, dim)
    graphs = {
        "attention_inputs": (onnx_layers.attention_inputs(spec, layer, 0), {"x": x, "cos": rand(rows, dim), "sin": rand(rows, dim)}),
        "layer_output": (onnx_layers.layer_output(spec, layer, 0), {"x": x, "context": rand(rows, heads * dim)}),
        "final_norm": (onnx_layers.final_norm(spec, RMSNorm(load("model.norm.weight"), spec.rms_norm_eps)), {"x": x}),
        "attention": (
            onnx_layers.attention(spec),
            {
                "q": rand(1, 3, heads * dim),
                "k": rand(1, 3, kv * dim),
                "v": rand(1, 3, kv * dim),
                "cache_key": cache,
                "cache_value": cache.copy(),
                "seqlens_k": np.array([4], np.int32),
                "total_sequence_length": np.array(5, np.int32),
            },
        ),
    }
    if "lm_head.weight_scale" in files.checkpoint.names:
        graphs["int8_head"] = (onnx_layers.int8_head(spec, load_linear(load, "lm_head")), {"x": x})
    return graphs


@pytest.fixture(scope="module")
def cases(tiny_qwen3, tiny_artifact, tiny_static_artifact, tiny_int8_head_artifact, tiny_onnx, tmp_path_factory) -> dict[str, dict]:
    """``{name: job}`` for ``ort_runner``: each model written to a file, its feed to an .npz beside it."""
    root = tmp_path_factory.mktemp("onnx-runtimes")
    exports = {
        "integer": tiny_onnx,
        "qdq": export(tiny_static_artifact.path, "onnx", root / "qdq", linear_format="qdq", progress=False),
        "float": export(tiny_qwen3, "onnx", root / "float", precision="float", progress=False),
        "head_outside": export(tiny_artifact.path, "onnx", root / "outside", head_outside=True, progress=False),
        "int8_head": export(tiny_int8_head_artifact.path, "onnx", root / "int8-head", progress=False),
    }
    prefill = prefill_feed(tiny_artifact.spec, ONNX_PROMPT)  # every tiny model has tiny_qwen3's shape
    models = {name: (out / "model.onnx", prefill) for name, out in exports.items()}
    for name, (model, feed) in _layer_graphs(tiny_int8_head_artifact, rows=5).items():
        (root / f"{name}.onnx").write_bytes(model)
        models[f"layers_{name}"] = (root / f"{name}.onnx", feed)
    probe, _, codes = int8_probe()
    onnx.save_model(probe, str(root / "probe.onnx"))
    models["int8_probe"] = (root / "probe.onnx", {"x": codes})
    jobs = {}
    for name, (model, feed) in models.items():
        np.savez(root / f"{name}.feed.npz", **feed)
        jobs[name] = {"name": name, "model": str(model), "feed": str(root / f"{name}.feed.npz")}
    return jobs


def _config() -> list[list[str]]:
    """The session config the backend runs graphs with (exact u8 x s8 on this CPU), for every release alike."""
    return [list(entry) for entry in bit_exact_int8_entries()]


@pytest.fixture(scope="module")
def expected(cases, tmp_path_factory) -> dict[str, dict[str, np.ndarray]]:
    """Each model's outputs on the suite's own ONNX Runtime, run as the child process runs them."""
    root = tmp_path_factory.mktemp("onnx-runtimes-expected")
    outputs = {}
    for name, job in cases.items():
        ort_runner.run({**job, "out": str(root / f"{name}.npz")}, _config())
        with np.load(root / f"{name}.npz") as saved:
            outputs[name] = dict(saved)
    return outputs


def _environment(release: str) -> dict[str, str]:
    """The child's environment: this Python as it is for the suite's own release, else with the release's folder first on
    its path; a release installed in neither fails under CI and skips elsewhere."""
    own = onnxruntimes.installed()
    if own is not None and Version(own) == Version(release):
        return dict(os.environ)
    if onnxruntimes.is_installed_in(RUNTIMES, release):
        path = os.pathsep.join(p for p in (str(onnxruntimes.runtime_dir(RUNTIMES, release)), os.environ.get("PYTHONPATH")) if p)
        return {**os.environ, "PYTHONPATH": path}
    where = ", ".join(RELEASES[release])
    message = f"ONNX Runtime {release} ({where}) is not installed in {RUNTIMES}: python tools/onnxruntimes.py install {RUNTIMES}"
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)


def _declared(model_path: str) -> tuple[int, dict[str, int]]:
    model = onnx.load(model_path, load_external_data=False)
    return model.ir_version, {entry.domain or "ai.onnx": entry.version for entry in model.opset_import}


@pytest.mark.parametrize("precise", [False, True], ids=["this-cpus-config", "x64quantprecision"])
@pytest.mark.parametrize("release", list(RELEASES))
def test_every_model_runs_on_each_pinned_onnxruntime(release, precise, cases, expected, tmp_path):
    """Under this CPU's session config and under the one CPUs whose u8 x s8 sums saturate get (AVX2: ONNX Runtime 1.20
    and 1.21 aborted there on graphs whose MatMulInteger left its weight zero point implicit), on any CPU: the option
    runs ORT's exact u8 x u8 kernel, so the outputs are the same."""
    env = _environment(release)
    jobs = [{**job, "out": str(tmp_path / f"{name}.npz")} for name, job in cases.items()]
    plan = tmp_path / "plan.json"
    config = [list(PRECISE_INT8_OPTION)] if precise else _config()
    plan.write_text(json.dumps({"config": config, "jobs": jobs}))
    result = subprocess.run([sys.executable, str(RUNNER), str(plan)], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout.splitlines()[-1])
    assert Version(report["release"]) == Version(release), f"the child imported ONNX Runtime {report['release']}"

    known, too_new = report["opsets"], {}
    for name, job in cases.items():
        _, opsets = _declared(job["model"])
        too_new |= {f"{name} {domain}": (v, known.get(domain)) for domain, v in opsets.items() if v > known.get(domain, 0)}
    assert not too_new, f"opsets above what ONNX Runtime {release} knows (declared, known): {too_new}"
    assert not report["errors"], f"ONNX Runtime {release} refused: {report['errors']}"

    for name in cases:
        with np.load(tmp_path / f"{name}.npz") as saved:
            got = dict(saved)
        assert got.keys() == expected[name].keys(), name
        for output, want in expected[name].items():
            if want.dtype.kind in "iu":
                np.testing.assert_array_equal(got[output], want, err_msg=f"{name}: {output}")
            else:
                np.testing.assert_allclose(got[output], want, rtol=RTOL, atol=ATOL, err_msg=f"{name}: {output}")


def test_every_model_declares_the_versions_of_its_form(cases):
    """Each model states its form's opset and that opset's IR version, never the installed onnx's own (onnx 1.23 would
    write IR 14, which ORT releases before 1.23 refuse)."""
    forms = {"qdq": "qdq", "float": "integer"}  # a float graph is built as the integer form's, with no int8 linear
    for name, job in cases.items():
        ir_version, opsets = _declared(job["model"])
        opset = OPSETS[forms.get(name, "integer")]
        assert opsets["ai.onnx"] == opset and ir_version == IR_VERSIONS[opset], (name, ir_version, opsets)
        assert set(opsets) <= {"ai.onnx", onnx_layers.CONTRIB} and opsets.get(onnx_layers.CONTRIB, 1) == 1, (name, opsets)


def test_each_ir_version_is_the_lowest_its_opset_allows():
    assert set(IR_VERSIONS) == set(OPSETS.values())
    for opset, ir_version in IR_VERSIONS.items():
        assert ir_version == helper.find_min_ir_version_for([helper.make_opsetid("", opset)]), opset


def test_the_bench_graphs_declare_their_versions():
    from quasar_deploy.bench.onnx import _chain
    from quasar_deploy.scheme import quantize_weight

    weights = [quantize_weight(torch.randn(16, 16))]
    for form in ("fp32", "integer", "qdq"):
        model = _chain(weights, form, [0.1])
        (opset,) = model.opset_import
        assert opset.version in OPSETS.values() and model.ir_version == IR_VERSIONS[opset.version], form


def test_the_pins_are_read_from_the_files_that_pin_them(tmp_path):
    """Each image's ``onnxruntime`` or ``onnxruntime-gpu`` pin and the extra's floor, one entry per release."""
    for image, line in (("cpu", "onnxruntime==1.30.0"), ("gpu", "onnxruntime-gpu==1.19.2  # its TensorRT"), ("cuda", "vllm==0.1")):
        (tmp_path / "docker" / image).mkdir(parents=True)
        (tmp_path / "docker" / image / "constraints.txt").write_text(f"# pins\nnumpy==2.0\n{line}\n")
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\noptional-dependencies = {onnx = ["onnx>=1.16", "onnxruntime>=1.19.2,<2"]}\n')
    assert onnxruntimes.pinned(tmp_path) == {
        "1.19.2": ["docker/gpu/constraints.txt", "pyproject.toml [onnx] floor"],
        "1.30.0": ["docker/cpu/constraints.txt"],
    }
    pyproject.write_text('[project]\noptional-dependencies = {onnx = ["onnxruntime"]}\n')
    with pytest.raises(ValueError, match="has no lower bound"):
        onnxruntimes.pinned(tmp_path)
