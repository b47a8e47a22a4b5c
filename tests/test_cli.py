"""The CLI: every user-fixable failure is one line on stderr and exit code 1, never a traceback."""

import json

import pytest
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from quasar_deploy.cli import main


def run(*args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result


@pytest.fixture(scope="module")
def artifact(tiny_qwen3, tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "w8a8"
    result = run("calibrate", tiny_qwen3, "--output", out, "--num-samples", 4, "--seq-len", 32)
    assert result.exit_code == 0, result.output
    assert "error before" in result.output and "model.layers.2.down" in result.output
    return out


def assert_one_line_error(result, text):
    assert result.exit_code == 1
    assert "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines[-1].startswith("error: ") and text in lines[-1], result.output


def test_eval_reports_fidelity(artifact, tiny_qwen3):
    result = run("eval", artifact, "--reference", tiny_qwen3, "--num-samples", 3, "--seq-len", 32, "--json")
    assert result.exit_code == 0, result.output
    figures = json.loads(result.output)["sets"]["built-in"]
    assert figures["top1_agreement"] > 0.8 and figures["mean_kl"] < 0.05 and figures["tokens"] > 0


def test_eval_per_set_and_layer_table(artifact, tiny_qwen3, tmp_path):
    code = tmp_path / "code.txt"
    code.write_text("def add(a, b):\n    return a + b\n\nprint(add(1, 2))\n")
    prose = tmp_path / "prose.jsonl"
    prose.write_text('{"turns": ["The weather was calm and the sea was flat."]}\n')
    result = run("eval", artifact, "--reference", tiny_qwen3, "--data", code, "--data", prose, "--layers", "--num-samples", 2)
    assert result.exit_code == 0, result.output
    assert "code " in result.output and "prose " in result.output
    assert "model.layers.0.self_attn.q_proj" in result.output


def test_smoothing_study_compares_alphas(tiny_qwen3):
    result = run("smoothing-study", "--reference", tiny_qwen3, "--num-samples", 2, "--seq-len", 32, "--json")
    assert result.exit_code == 0, result.output
    study = json.loads(result.output)
    assert [r["alpha"] for r in study["rows"]] == ["off", 0.5, "auto"]
    assert set(study["layers"]) == {"model alpha=off", "model alpha=0.5", "model alpha=auto"}


def test_doctor_lists_every_target():
    result = run("doctor", "--json")
    assert result.exit_code == 0
    info = json.loads(result.output)
    assert info["targets"]["cpu"] is None
    assert {"cuda", "npu", "onnxruntime"} <= set(info["targets"])


def test_missing_directory(tmp_path):
    assert_one_line_error(run("calibrate", tmp_path / "nope", "-o", tmp_path / "out"), "no such directory")


def test_unsupported_architecture(tmp_path):
    import torch

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    save_file({"transformer.wte.weight": torch.zeros(4, 4)}, str(tmp_path / "model.safetensors"))
    assert_one_line_error(run("calibrate", tmp_path, "-o", tmp_path / "out"), "unsupported architecture 'GPT2LMHeadModel'")


def test_unreadable_calibration_file(tiny_qwen3, tmp_path):
    bad = tmp_path / "calib.jsonl"
    bad.write_bytes(b"\xff\xfe\x00garbage")
    assert_one_line_error(run("calibrate", tiny_qwen3, "-o", tmp_path / "out", "--calib-data", bad), "unreadable")
    bad.write_text('{"text": "ok"}\n{not json\n')
    assert_one_line_error(run("calibrate", tiny_qwen3, "-o", tmp_path / "out", "--calib-data", bad), "invalid JSON")
    assert not (tmp_path / "out").exists()


def test_existing_output_is_not_overwritten(tiny_qwen3, artifact):
    assert_one_line_error(run("calibrate", tiny_qwen3, "-o", artifact), "already exists")


def _copy(artifact, tmp_path):
    import shutil

    target = tmp_path / "copy"
    shutil.copytree(artifact, target)
    return target


def test_corrupted_artifact(artifact, tiny_qwen3, tmp_path):
    broken = _copy(artifact, tmp_path)
    weights = broken / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-100] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert_one_line_error(run("eval", broken, "--reference", tiny_qwen3), "checksum mismatch")


def test_artifact_with_missing_tensor(artifact, tiny_qwen3, tmp_path):
    from quasar_deploy.files import sha256_files

    broken = _copy(artifact, tmp_path)
    weights = broken / "model.safetensors"
    tensors = load_file(str(weights))
    del tensors["model.layers.1.mlp.up_proj.weight_scale"]
    save_file(tensors, str(weights))
    manifest = json.loads((broken / "quasar.json").read_text())
    manifest["files"]["model.safetensors"] = sha256_files(weights)
    (broken / "quasar.json").write_text(json.dumps(manifest))
    assert_one_line_error(run("eval", broken, "--reference", tiny_qwen3), "'model.layers.1.mlp.up_proj.weight_scale' is missing")


def test_truncated_weights_file(artifact, tiny_qwen3, tmp_path):
    broken = _copy(artifact, tmp_path)
    (broken / "model.safetensors").write_bytes(b"\x10\x00")
    assert_one_line_error(run("eval", broken, "--reference", tiny_qwen3), "unreadable safetensors file")


def test_calibrate_on_a_missing_device(tiny_qwen3, tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert_one_line_error(run("calibrate", tiny_qwen3, "-o", tmp_path / "out", "--device", "cuda"), "--device cuda: no CUDA device visible")
    assert not (tmp_path / "out").exists()
