"""The CLI: every user-fixable failure is one line on stderr and exit code 1, never a traceback."""

import json

import pytest
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from quasar_deploy.artifact import open_model_files
from quasar_deploy.cli import main

from .helpers import assert_one_line_error, copy_dir


def run(*args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result


@pytest.fixture
def artifact(tiny_artifact):
    return tiny_artifact.path


def test_calibrate_writes_an_artifact_and_prints_the_layer_table(tiny_qwen3, tmp_path):
    out = tmp_path / "w8a8"
    result = run("calibrate", tiny_qwen3, "--output", out, "--num-samples", 4, "--seq-len", 32)
    assert result.exit_code == 0, result.output
    assert "error before" in result.output and "model.layers.2.down" in result.output
    files = open_model_files(out)
    assert files.is_artifact and len(files.manifest["quantized_layers"]) == 3 * 7
    assert files.manifest["recipe"]["num_samples"] == 4 and files.manifest["recipe"]["seq_len"] == 32


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
    rows = {line.split()[0]: line.split()[1:] for line in result.output.splitlines() if line.strip()}
    for name in ("code", "prose"):  # one row per --data set: tokens, top-1, KL, two perplexities
        assert len(rows[name]) == 5 and int(rows[name][0]) > 0 and 0 <= float(rows[name][1]) <= 1, rows[name]
    for layer, record in open_model_files(artifact).manifest["layers"].items():  # and one per layer, its recorded error
        assert rows[layer] == ["float" if record["error"] is None else f"{record['error']:.3e}"], layer


@pytest.mark.slow
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
    # each registered backend's entry is its own availability check's answer; cuda (not built yet) always gives a reason
    from quasar_deploy.backends import available_backends

    assert {name: info["targets"][name] for name in available_backends()} == available_backends()
    assert isinstance(info["targets"]["cuda"], str) and info["targets"]["cuda"]


def test_doctor_with_a_model_prints_the_memory_it_needs(artifact):
    from quasar_deploy.memory import estimate

    result = run("doctor", artifact)
    assert result.exit_code == 0, result.output
    [line] = [line for line in result.output.splitlines() if line.startswith("memory")]
    assert "int8 weights" in line and "KV cache" in line
    info = json.loads(run("doctor", artifact, "--json").output)["memory"]
    assert info["total"] == estimate(open_model_files(artifact)).total(info["tokens"]) and info["int8_weights"] > 0


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


def test_corrupted_artifact(artifact, tiny_qwen3, tmp_path):
    broken = copy_dir(artifact, tmp_path)
    weights = broken / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-100] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert_one_line_error(run("eval", broken, "--reference", tiny_qwen3), "checksum mismatch")


def test_artifact_with_missing_tensor(artifact, tiny_qwen3, tmp_path):
    from quasar_deploy.files import sha256_files

    broken = copy_dir(artifact, tmp_path)
    weights = broken / "model.safetensors"
    tensors = load_file(str(weights))
    del tensors["model.layers.1.mlp.up_proj.weight_scale"]
    save_file(tensors, str(weights))
    manifest = json.loads((broken / "quasar.json").read_text())
    manifest["files"]["model.safetensors"] = sha256_files(weights)
    (broken / "quasar.json").write_text(json.dumps(manifest))
    assert_one_line_error(run("eval", broken, "--reference", tiny_qwen3), "'model.layers.1.mlp.up_proj.weight_scale' is missing")


def test_truncated_weights_file(artifact, tiny_qwen3, tmp_path):
    broken = copy_dir(artifact, tmp_path)
    (broken / "model.safetensors").write_bytes(b"\x10\x00")
    assert_one_line_error(run("eval", broken, "--reference", tiny_qwen3), "checksum mismatch")  # checked before parsed
    checkpoint = copy_dir(tiny_qwen3, tmp_path, "checkpoint")  # no manifest: the parser's error, in one line
    (checkpoint / "model.safetensors").write_bytes(b"\x10\x00")
    assert_one_line_error(run("eval", artifact, "--reference", checkpoint), "unreadable safetensors file")


def test_calibrate_on_a_missing_device(tiny_qwen3, tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert_one_line_error(run("calibrate", tiny_qwen3, "-o", tmp_path / "out", "--device", "cuda"), "--device cuda: no CUDA device visible")
    assert not (tmp_path / "out").exists()
