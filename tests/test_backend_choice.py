"""``backend="auto"`` on a CPU with ONNX Runtime: the artifact's exact integer graph, exported once into the cache, where
the int8 probe picks a library kernel; the cpu backend where it picks our own (``registry.cpu_runs_better``).

What the choice must keep: the same tokens as the cpu backend's exact kernels, one export per model content (two
processes started together included), a damaged cache entry repaired rather than run, a changed model re-exported,
the torch decoder where a drafter needs it, and the cpu backend where ONNX Runtime's copy would not fit in memory.
"""

from __future__ import annotations

import os
import threading

import pytest

from quasar_deploy.artifact import open_model_files
from quasar_deploy.backends import onnx_export_cache, registry
from quasar_deploy.errors import QuasarError

from .helpers import copy_dir

pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")

PROMPT = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n"


@pytest.fixture(autouse=True)
def library_int8_kernel(monkeypatch):
    """A CPU whose int8 probe picks a library kernel, where artifacts go to ONNX Runtime: whichever the probe picks on the
    CPU running the suite (``test_our_int8_kernel_keeps_artifacts_on_the_cpu_backend`` covers the other branch)."""
    from quasar_deploy.cpu import choice

    monkeypatch.setattr(choice, "default_int8_kernel", lambda device="cpu": "onednn-vnni")


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("QUASAR_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_auto_runs_an_artifact_on_its_cached_integer_graph_with_the_exact_kernels_tokens(tiny_artifact, empty_cache, capfd):
    from quasar_deploy import load

    engine = load(tiny_artifact.path)
    assert engine.backend == "onnxruntime" and "W8A8 integer graph" in engine.lm.description
    assert "exporting it to" in capfd.readouterr().err  # the first use says what it does
    exact = load(tiny_artifact.path, backend="cpu", int8_kernel="reference")
    for draft in ("ngram", "none"):
        assert (
            engine.generate(PROMPT, max_new_tokens=24, draft=draft).tokens == exact.generate(PROMPT, max_new_tokens=24, draft=draft).tokens
        )
    exports = [p.name for p in empty_cache.iterdir() if p.name.startswith("onnx-")]  # beside them: built C kernels, .index
    assert exports == [onnx_export_cache.onnx_export_path(tiny_artifact.path).name]

    load(tiny_artifact.path)
    assert "exporting" not in capfd.readouterr().err  # reused


def test_a_float_checkpoint_is_exported_as_a_float_graph(tiny_qwen3, empty_cache):
    from quasar_deploy import load

    engine = load(tiny_qwen3)
    assert engine.backend == "onnxruntime" and "(float graph), " in engine.lm.description


def test_a_damaged_cache_entry_is_exported_again(tiny_artifact, empty_cache, capfd):
    from quasar_deploy import load

    path = onnx_export_cache.cached_onnx_export(tiny_artifact, progress=False)
    (path / "model.onnx").write_bytes(b"damaged")
    engine = load(tiny_artifact.path)
    assert "the cached ONNX export is damaged" in capfd.readouterr().err
    assert engine.generate(PROMPT, max_new_tokens=4).tokens  # it runs the new export


def test_the_key_follows_the_model_content(tiny_artifact, tiny_qwen3, tmp_path, empty_cache):
    artifact = copy_dir(tiny_artifact.path, tmp_path, "artifact")
    assert onnx_export_cache.content_key(artifact) == onnx_export_cache.content_key(tiny_artifact.path)  # same content, another place
    assert onnx_export_cache.content_key(artifact) != onnx_export_cache.content_key(tiny_qwen3)
    checkpoint = copy_dir(tiny_qwen3, tmp_path, "checkpoint")
    before = onnx_export_cache.content_key(checkpoint)
    weights = next(checkpoint.glob("*.safetensors"))
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 1))  # touched, the same bytes
    assert onnx_export_cache.content_key(checkpoint) == before
    weights.write_bytes(weights.read_bytes()[:-1] + b"!")  # rewritten weights
    assert onnx_export_cache.content_key(checkpoint) != before
    with pytest.raises(QuasarError, match="no config.json"):
        onnx_export_cache.content_key(tmp_path)


def test_processes_started_together_export_once(tiny_artifact, empty_cache, capfd):
    paths: list = []
    threads = [
        threading.Thread(target=lambda: paths.append(onnx_export_cache.cached_onnx_export(tiny_artifact, progress=False))) for _ in range(3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(paths)) == 1 and len(paths) == 3
    assert capfd.readouterr().err.count("exporting it to") == 1


def test_needs_and_options_choose_a_backend_that_provides_them(tiny_artifact, tiny_qwen3):
    from quasar_deploy.serve.needs import SERVER_NEEDS

    assert registry.auto_backend(tiny_artifact) == "onnxruntime"
    # the layerskip drafter, and serving (requests may pick layerskip): ONNX Runtime's layer graphs of a W8A8 artifact
    assert registry.auto_backend(tiny_artifact, needs=("layer_skip",)) == "onnxruntime"
    assert registry.auto_backend(tiny_artifact, needs=SERVER_NEEDS) == "onnxruntime"
    # ...which a float checkpoint has none of: our torch decoder
    assert registry.auto_backend(open_model_files(tiny_qwen3), needs=SERVER_NEEDS) == "cpu"
    assert registry.auto_backend(tiny_artifact, options=("int8_kernel",)) == "cpu"
    with pytest.raises(QuasarError, match="unknown backend capability 'gpu'"):
        registry.auto_backend(tiny_artifact, needs=("gpu",))


def test_our_int8_kernel_keeps_artifacts_on_the_cpu_backend(tiny_artifact, tiny_qwen3, monkeypatch):
    """Where the probe picks ``quasar`` and times it faster than ONNX Runtime's int8 linear, the cpu backend runs W8A8
    steps faster than ONNX Runtime's graphs (alone and batched: docs/architecture.md), so auto keeps artifacts there,
    for generation and serving; float checkpoints are not its business."""
    from quasar_deploy.cpu import choice
    from quasar_deploy.serve.needs import SERVER_NEEDS

    monkeypatch.setattr(choice, "default_int8_kernel", lambda device="cpu": "quasar")
    monkeypatch.setattr(choice, "int8_probe", lambda: choice.Int8Probe({"quasar": 1.0, choice.ONNXRUNTIME: 2.0}))
    assert registry.auto_backend(tiny_artifact) == "cpu"
    assert registry.auto_backend(tiny_artifact, needs=SERVER_NEEDS) == "cpu"
    assert registry.auto_backend(open_model_files(tiny_qwen3)) == "onnxruntime"  # float32 here (the suite's float dtype): ORT's float graph


def test_onnxruntime_is_not_chosen_where_its_copy_would_not_fit(tiny_artifact, monkeypatch):
    from quasar_deploy.artifact import open_model_files
    from quasar_deploy.cpu import machine
    from quasar_deploy.memory import estimate, report_tokens

    files = open_model_files(tiny_artifact.path)
    needed = estimate(files).total(report_tokens(files.spec)) * registry.ONNXRUNTIME_MEMORY_FACTOR
    monkeypatch.setattr(machine, "memory_available", lambda: needed - 1)
    assert registry.auto_backend(tiny_artifact) == "cpu"
    monkeypatch.setattr(machine, "memory_available", lambda: needed)
    assert registry.auto_backend(tiny_artifact) == "onnxruntime"


@pytest.mark.parametrize(("int8_kernel", "artifacts"), [("quasar", "cpu"), ("onednn-vnni", "onnxruntime")])
def test_doctor_names_what_auto_gives_each_kind_of_model(int8_kernel, artifacts, monkeypatch):
    from click.testing import CliRunner

    from quasar_deploy.cli import main
    from quasar_deploy.cpu import choice

    monkeypatch.setattr(choice, "default_int8_kernel", lambda device="cpu": int8_kernel)
    monkeypatch.setattr(choice, "int8_probe", lambda: choice.Int8Probe({int8_kernel: 1.0, choice.ONNXRUNTIME: 2.0}))
    output = CliRunner().invoke(main, ["doctor"]).output
    expected = f"backend        {artifacts} for W8A8 artifacts, onnxruntime for float checkpoints (--backend auto"
    assert expected in output and f"--draft layerskip and serve: {artifacts} and cpu)" in output
