"""The backend and drafter registries: names readable without torch, one-line errors, and who can skip layers."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

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
    cpu = create_backend("cpu", tiny_qwen3)
    assert isinstance(cpu, CausalLM) and isinstance(cpu, LayerSkippingLM)
    full = cpu.verify([5, 6, 7])
    cpu.truncate(0)
    skipped = cpu.verify_skipping([5, 6, 7], frozenset({1}))  # it really skips: same shape, other logits
    assert skipped.shape == full.shape == (3, 4096) and not torch.equal(skipped, full)
    assert isinstance(OrtLike(), CausalLM) and not isinstance(OrtLike(), LayerSkippingLM)


def test_auto_backend_follows_what_the_directory_holds(tiny_qwen3, tmp_path):
    pytest.importorskip("onnxruntime")
    from quasar_deploy.engine import load
    from quasar_deploy.exporters import export

    onnx_dir = export(tiny_qwen3, "onnx", tmp_path / "onnx", precision="float")
    engine = load(onnx_dir)
    assert engine.lm.description.startswith("onnxruntime") and engine.backend == "auto"
    assert engine.generate("def f():", max_new_tokens=4).tokens == load(tiny_qwen3).generate("def f():", max_new_tokens=4).tokens
    npu_dir = tmp_path / "npu"
    npu_dir.mkdir()
    (npu_dir / "quant_model_description.json").write_text("{}")
    with pytest.raises(QuasarError, match="served by vLLM-Ascend"):
        load(npu_dir)
