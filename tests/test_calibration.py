"""Calibration end to end on tiny random checkpoints: the artifact, its numerics, and what smoothing buys."""

import json
from dataclasses import FrozenInstanceError
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import quasar_deploy
from quasar_deploy import QuasarError, calibrate
from quasar_deploy.artifact import open_model_files
from quasar_deploy.calibration import CalibrationRecipe
from quasar_deploy.outliers import write_outlier_variant

from .helpers import FAST_CALIBRATION as FAST


def _logits(path, ids):
    decoder = open_model_files(path).decoder()
    return decoder(ids, decoder.new_cache())


def _relative_error(path, reference, ids):
    quantized, exact = _logits(path, ids), _logits(reference, ids)
    return float((quantized - exact).norm() / exact.norm())


IDS = torch.randint(1, 4096, (48,), generator=torch.Generator().manual_seed(3))


def test_artifact_layout_is_compressed_tensors_w8a8(tiny_artifact, tiny_qwen3):
    from compressed_tensors.quantization import QuantizationConfig

    path = tiny_artifact.path
    config = json.loads((path / "config.json").read_text())
    qc = QuantizationConfig.model_validate(config["quantization_config"])
    assert qc.quant_method == "compressed-tensors" and qc.format == "int-quantized"
    scheme = qc.config_groups["group_0"]
    assert scheme.targets == ["Linear"]
    assert (scheme.weights.num_bits, scheme.weights.strategy, scheme.weights.symmetric) == (8, "channel", True)
    assert (scheme.input_activations.strategy, scheme.input_activations.dynamic) == ("token", True)
    assert "lm_head" in qc.ignore
    with safe_open(path / "model.safetensors", "pt") as f:
        names = set(f.keys())
        w = f.get_tensor("model.layers.0.self_attn.q_proj.weight")
        s = f.get_tensor("model.layers.0.self_attn.q_proj.weight_scale")
        assert w.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (w.shape[0], 1)
        assert f.get_tensor("lm_head.weight").dtype == torch.float32
    assert not any(n.endswith("input_scale") for n in names)
    manifest = json.loads((path / "quasar.json").read_text())
    assert manifest["format_version"] == 2 and len(manifest["source"]["sha256"]) == 64
    assert len(manifest["quantized_layers"]) == 3 * 7 and len(manifest["groups"]) == 3 * 4
    assert all(g["error_after"] <= g["error_before"] + 1e-12 for g in manifest["groups"])
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (path / name).read_bytes() == (tiny_qwen3 / name).read_bytes(), name


def test_w8a8_tracks_float(tiny_artifact, tiny_qwen3, tiny_llama, tmp_path):
    assert _relative_error(tiny_artifact.path, tiny_qwen3, IDS) < 0.03
    llama = calibrate(tiny_llama, tmp_path / "llama", **FAST)
    assert _relative_error(llama.path, tiny_llama, IDS) < 0.03


def test_static_activations_store_input_scale(tiny_static_artifact, tiny_qwen3):
    artifact = tiny_static_artifact
    config = json.loads((artifact.path / "config.json").read_text())["quantization_config"]
    activations = config["config_groups"]["group_0"]["input_activations"]
    assert (activations["strategy"], activations["dynamic"]) == ("tensor", False)
    with safe_open(artifact.path / "model.safetensors", "pt") as f:
        scale = f.get_tensor("model.layers.1.mlp.down_proj.input_scale")
    assert scale.dtype == torch.float32 and scale.shape == (1,) and float(scale) > 0
    assert _relative_error(artifact.path, tiny_qwen3, IDS) < 0.1


def test_outliers_hurt_naive_w8a8_and_smoothing_repairs_it(tiny_qwen3, tmp_path):
    outlier = write_outlier_variant(tiny_qwen3, tmp_path / "outlier")
    assert torch.equal(_logits(outlier, IDS), _logits(tiny_qwen3, IDS))  # the transform preserves the function
    err = {}
    for model, name in ((tiny_qwen3, "plain"), (outlier, "outlier")):
        for alpha in ("off", "auto"):
            artifact = calibrate(model, tmp_path / f"{name}-{alpha}", alpha=alpha, **FAST)
            err[name, alpha] = _relative_error(artifact.path, model, IDS)
    assert err["outlier", "off"] > 5 * err["plain", "off"]  # outliers wreck naive W8A8 ...
    assert err["outlier", "auto"] < err["outlier", "off"] / 5  # ... and smoothing repairs it
    assert err["outlier", "auto"] < 3 * err["plain", "auto"]


def test_keep_float_patterns(tiny_qwen3, tmp_path):
    artifact = calibrate(tiny_qwen3, tmp_path / "kf", keep_float=["*.down_proj", "model.layers.0.self_attn.q_proj"], **FAST)
    ignore = json.loads((artifact.path / "config.json").read_text())["quantization_config"]["ignore"]
    assert "model.layers.2.mlp.down_proj" in ignore and "model.layers.0.self_attn.q_proj" in ignore
    assert "model.layers.1.self_attn.q_proj" not in ignore
    decoder = artifact.decoder()
    assert not decoder.model.layers[1].mlp.down_proj.quantized
    assert decoder.model.layers[1].mlp.up_proj.quantized
    assert artifact.manifest["layers"]["model.layers.0.mlp.down_proj"]["float_reason"] == "keep-float pattern '*.down_proj'"


def test_keep_float_above_threshold(tiny_qwen3, tmp_path):
    artifact = calibrate(tiny_qwen3, tmp_path / "kfa", keep_float_above=0.0, **FAST)
    assert artifact.manifest["quantized_layers"] == []


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(keep_float=["nothing_matches"]), "matches no linear layer"),
        (dict(alpha="high"), "--alpha must be"),
        (dict(alpha=1.5), "--alpha must be in [0, 1]"),
        (dict(activation="per-channel"), "--activation must be"),
    ],
)
def test_bad_options(tiny_qwen3, tmp_path, kwargs, message):
    with pytest.raises(QuasarError, match=message.replace("[", r"\[").replace("]", r"\]")):
        calibrate(tiny_qwen3, tmp_path / "out", **{**FAST, **kwargs})
    assert not (tmp_path / "out").exists()


def test_interrupted_write_leaves_nothing(tiny_qwen3, tmp_path, monkeypatch):
    from quasar_deploy.shards import ShardWriter

    def broken(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(ShardWriter, "close", broken)  # every layer written, the last shard not yet closed
    with pytest.raises(KeyboardInterrupt):
        calibrate(tiny_qwen3, tmp_path / "out", **FAST)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "filename,content",
    [
        ("c.jsonl", '{"turns": ["def f(x):\\n    return x + 1\\n"]}\n{"inputs_pretokenized": "Question: 2 + 2?"}\n'),
        ("c.jsonl", '{"text": "import os\\nprint(os.getcwd())"}\n'),
        ("c.txt", "first paragraph of text\n\nsecond paragraph, a little longer than the first\n"),
    ],
)
def test_calibration_data_formats(tiny_qwen3, tmp_path, filename, content):
    data = tmp_path / filename
    data.write_text(content)
    artifact = calibrate(tiny_qwen3, tmp_path / "out", calib_data=data, **FAST)
    assert artifact.manifest["calibration"]["samples"] >= 1


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(alpha="high"), "--alpha must be 'auto', 'off' or a number in [0, 1], not 'high'"),
        (dict(alpha=None), "--alpha must be 'auto', 'off' or a number in [0, 1], not None"),
        (dict(alpha=1.5), "--alpha must be in [0, 1], not 1.5"),
        (dict(alpha="-0.1"), "--alpha must be in [0, 1], not -0.1"),
        (dict(activation="per-channel"), "--activation must be 'dynamic' or 'static', not 'per-channel'"),
        (dict(num_samples=0), "--num-samples must be an integer >= 1, not 0"),
        (dict(seq_len=1.5), "--seq-len must be an integer >= 2, not 1.5"),
        (dict(keep_float="*.down_proj"), "--keep-float must be a sequence of glob patterns, not '*.down_proj'"),
        (dict(keep_float_above="high"), "--keep-float-above must be a number, not 'high'"),
    ],
)
def test_recipe_validation_names_the_flag(kwargs, message):
    with pytest.raises(QuasarError) as info:
        CalibrationRecipe(**kwargs)
    assert str(info.value) == message


def test_recipe_normalizes_what_the_cli_and_callers_pass():
    recipe = CalibrationRecipe(alpha="0.5", keep_float=["*.down_proj"], calib_data=Path("c.jsonl"))
    assert recipe == CalibrationRecipe(alpha=0.5, keep_float=("*.down_proj",), calib_data="c.jsonl")
    assert recipe.to_dict() == {
        "alpha": 0.5,
        "activation": "dynamic",
        "num_samples": 64,
        "seq_len": 512,
        "keep_float": ["*.down_proj"],
        "keep_float_above": None,
        "calib_data": "c.jsonl",
        "int8_lm_head": False,
    }
    assert CalibrationRecipe(activation="static").scheme.activation == "static"
    assert quasar_deploy.CalibrationRecipe is CalibrationRecipe
    with pytest.raises(FrozenInstanceError):
        recipe.alpha = 1.0


def test_recipe_and_keywords_together_are_refused(tiny_qwen3, tmp_path):
    with pytest.raises(QuasarError, match=r"a recipe or its fields as keywords, not both \(got recipe= and alpha\)$"):
        calibrate(tiny_qwen3, tmp_path / "out", recipe=CalibrationRecipe(), alpha="off", progress=False)
    assert not (tmp_path / "out").exists()


def test_recipe_form_and_keyword_form_write_the_same_artifact(tiny_qwen3, tmp_path):
    keywords = dict(num_samples=4, seq_len=32, alpha="0.5", activation="static", keep_float=["*.down_proj"], keep_float_above=0.5)
    by_keywords = calibrate(tiny_qwen3, output=tmp_path / "keywords", progress=False, **keywords)
    by_recipe = calibrate(tiny_qwen3, tmp_path / "recipe", recipe=CalibrationRecipe(**keywords), progress=False)
    manifests = [{k: v for k, v in a.manifest.items() if k != "created"} for a in (by_keywords, by_recipe)]
    assert manifests[0] == manifests[1]
    assert manifests[0]["recipe"] == {
        "scheme": {"activation": "static"},
        "alpha": 0.5,
        "alpha_grid": None,
        "num_samples": 4,
        "seq_len": 32,
        "keep_float": ["*.down_proj"],
        "keep_float_above": 0.5,
        "int8_lm_head": False,
    }


def test_demo_cache_key_follows_the_recipe(monkeypatch, tmp_path):
    import quasar_deploy.calibration
    from quasar_deploy import demo

    monkeypatch.setenv("QUASAR_CACHE", str(tmp_path))
    used = []
    monkeypatch.setattr(quasar_deploy.calibration, "calibrate", lambda model, output, recipe, progress: used.append((output, recipe)))
    default = demo.demo_artifact(progress=False)
    assert used == [(default, demo.demo_recipe())]
    monkeypatch.setattr(demo, "demo_recipe", lambda: CalibrationRecipe(num_samples=8, seq_len=256))
    assert demo.demo_artifact(progress=False) != default
