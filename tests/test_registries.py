"""The backend and drafter registries: names readable without torch, one-line errors, and who can skip layers."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from quasar_deploy.artifact import open_model_files
from quasar_deploy.backends import BACKENDS, available_backends, create_backend
from quasar_deploy.engine import GenerationOptions
from quasar_deploy.errors import QuasarError
from quasar_deploy.speculative.causal_lm import CausalLM, LayerSkippingLM
from quasar_deploy.speculative.registry import DRAFTERS, create_drafter


def test_reading_the_registries_imports_no_torch():
    code = (
        "import sys, quasar_deploy.speculative.registry, quasar_deploy.backends, quasar_deploy.speculative\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith(('torch', 'quasar')))\n"
        "print(sorted(quasar_deploy.backends.BACKENDS), sorted(quasar_deploy.speculative.registry.DRAFTERS))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"{sorted(BACKENDS)} {sorted(DRAFTERS)}"


def test_an_unknown_backend_is_one_line_listing_the_names(tmp_path):
    with pytest.raises(QuasarError) as error:
        create_backend("tpu", tmp_path)
    message = str(error.value)
    assert "\n" not in message and message == f"unknown backend 'tpu'; choose from auto, {', '.join(BACKENDS)}"


def test_every_backend_reports_whether_it_can_run():
    reasons = available_backends()
    assert list(reasons) == list(BACKENDS) and reasons["cpu"] is None
    assert all(reason is None or (isinstance(reason, str) and "\n" not in reason) for reason in reasons.values())


def test_an_unknown_drafter_is_one_line_listing_the_names():
    for build in (lambda: GenerationOptions(draft="medusa"), lambda: create_drafter("medusa", None, {})):
        with pytest.raises(QuasarError) as error:
            build()
        assert str(error.value) == f"unknown drafter 'medusa'; choose from {', '.join(DRAFTERS)}"


@pytest.mark.parametrize(
    "options,option,owner",
    [
        (dict(draft="ngram", skip_layers=[1]), "skip_layers", "layerskip"),
        (dict(draft="none", skip_fraction=0.3), "skip_fraction", "layerskip"),
        (dict(draft="layerskip", draft_model="/some/draft"), "draft_model", "model"),
        (dict(draft="model", draft_model="/some/draft", ngram_max=5), "ngram_max", "ngram"),
    ],
)
def test_a_drafter_option_for_another_drafter_names_both(options, option, owner):
    with pytest.raises(QuasarError, match=f"^{option} applies to draft='{owner}', not draft='{options['draft']}'$"):
        GenerationOptions(**options)


def test_each_drafter_option_belongs_to_one_drafter_and_is_a_generation_option():
    fields = set(GenerationOptions.__dataclass_fields__)
    owned = [option for entry in DRAFTERS.values() for option in entry.options]
    assert len(owned) == len(set(owned)) and set(owned) <= fields


class OrtLike:
    """What an exported-graph backend looks like: a full ``CausalLM`` with a layer count, but no way to skip."""

    vocab_size = 8
    max_length = 16
    num_layers = 3
    length = 0

    def prefill(self, ids):
        raise AssertionError

    def verify(self, ids):
        raise AssertionError

    def truncate(self, length):
        raise AssertionError


def test_only_backends_that_can_skip_layers_are_layer_skipping(tiny_qwen3):
    cpu = create_backend("cpu", open_model_files(tiny_qwen3))
    assert isinstance(cpu, CausalLM) and isinstance(cpu, LayerSkippingLM)
    full = cpu.verify([5, 6, 7])
    cpu.truncate(0)
    skipped = cpu.verify_skipping([5, 6, 7], frozenset({1}))  # it really skips: same shape, other logits
    assert skipped.shape == full.shape == (3, 4096) and not torch.equal(skipped, full)
    assert isinstance(OrtLike(), CausalLM) and not isinstance(OrtLike(), LayerSkippingLM)


def test_auto_backend_follows_what_the_directory_holds(tiny_qwen3, tiny_artifact, tiny_onnx, tmp_path, monkeypatch):
    from quasar_deploy.api import load
    from quasar_deploy.backends.registry import auto_backend, auto_choice, export_backend
    from quasar_deploy.cpu import choice

    pytest.importorskip("onnxruntime")
    monkeypatch.setattr(choice, "default_int8_kernel", lambda device="cpu": "onednn-vnni")  # a CPU whose int8 probe picks a library kernel
    # no GPU here, onnxruntime installed: the exact integer graph, exported to the cache on first use (test_backend_choice.py)
    checkpoint = open_model_files(tiny_qwen3)
    assert auto_backend(checkpoint) == auto_backend(tiny_artifact) == auto_choice(True) == auto_choice(False) == "onnxruntime"
    # skipping layers: ONNX Runtime's layer graphs of a W8A8 artifact; a float checkpoint has none, so our torch decoder
    assert auto_backend(tiny_artifact, needs=("layer_skip",)) == auto_choice(True, ("layer_skip",)) == "onnxruntime"
    assert auto_backend(checkpoint, needs=("layer_skip",)) == auto_choice(False, ("layer_skip",)) == "cpu"
    assert export_backend("auto", tiny_onnx) == "onnxruntime"  # routed by the target its quasar-export.json records
    engine = load(tiny_onnx)
    assert engine.lm.description.startswith("onnxruntime") and engine.backend == "onnxruntime"
    assert (
        engine.generate("def f():", max_new_tokens=4).tokens
        == load(tiny_onnx, backend="onnxruntime").generate("def f():", max_new_tokens=4).tokens
    )


def test_an_explicit_backend_wins_over_auto(tiny_artifact):
    from quasar_deploy.api import load

    assert load(tiny_artifact.path, backend="cpu", int8_kernel="reference").lm.description.startswith("cpu W8A8")
    assert load(tiny_artifact.path, int8_kernel="reference").backend == "cpu"  # auto: the backend that takes the option
    with pytest.raises(QuasarError, match="backend 'onnxruntime' takes no option 'int8_kernel'"):
        load(tiny_artifact.path, backend="onnxruntime", int8_kernel="reference")


def _export_dir(tmp_path, target, marker=None):
    directory = tmp_path / f"{target}-export"
    directory.mkdir()
    if target is not None:
        (directory / "quasar-export.json").write_text(json.dumps({"format_version": 1, "target": target, "files": {}}))
    if marker is not None:
        (directory / marker).write_text("{}")
    return directory


@pytest.mark.parametrize(
    ("target", "marker", "message"),
    [
        ("npu", None, "served by vLLM-Ascend"),
        (None, "quant_model_description.json", "served by vLLM-Ascend"),  # an NPU export whose manifest was not copied
        ("tensorrt-llm", None, "a 'tensorrt-llm' export, which no backend of this quasar-deploy runs"),
        (None, "genai_config.json", "no quasar-export.json"),  # routed to onnxruntime, whose loader explains what is missing
    ],
)
def test_exports_are_routed_or_refused_in_one_line(tmp_path, target, marker, message):
    from quasar_deploy.api import load

    pytest.importorskip("onnxruntime")
    with pytest.raises(QuasarError, match=message) as error:
        load(_export_dir(tmp_path, target, marker))
    assert "\n" not in str(error.value)


def test_a_corrupted_export_manifest_is_one_line(tmp_path):
    from quasar_deploy.backends.registry import export_backend

    directory = _export_dir(tmp_path, "onnx")
    (directory / "quasar-export.json").write_text("{not json")
    with pytest.raises(QuasarError, match="not valid JSON"):
        export_backend("auto", directory)
    (directory / "quasar-export.json").write_text("[]")
    with pytest.raises(QuasarError, match="expected a JSON object, not list"):
        export_backend("auto", directory)
    (directory / "quasar-export.json").write_text("{}")
    with pytest.raises(QuasarError, match="no 'target' string"):
        export_backend("auto", directory)


def test_generate_runs_an_onnx_export_without_backend_and_names_the_backend(tiny_onnx, tiny_artifact, monkeypatch):
    from click.testing import CliRunner

    from quasar_deploy.cli import main
    from quasar_deploy.cpu import choice

    pytest.importorskip("onnxruntime")
    monkeypatch.setattr(choice, "default_int8_kernel", lambda device="cpu": "onednn-vnni")  # a CPU whose int8 probe picks a library kernel
    for path, options, backend in (
        (tiny_onnx, [], "backend: onnxruntime CPUExecutionProvider (W8A8 integer graph)"),
        (tiny_artifact.path, [], "backend: onnxruntime CPUExecutionProvider (W8A8 integer graph)"),
        (tiny_artifact.path, ["--draft", "layerskip"], "backend: onnxruntime cpu (W8A8 integer layer graphs"),  # skips layers
        (tiny_artifact.path, ["--backend", "cpu"], "backend: cpu W8A8"),
    ):
        args = ["generate", str(path), "--prompt", "def f():", "--max-new-tokens", "4", "--stats", *options]
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 0, result.output
        assert backend in result.output and "decode_tokens_per_s" in result.output and "prefill_s" in result.output
