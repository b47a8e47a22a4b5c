"""Integrity that cannot be bypassed: a directory we wrote loads only as exactly the files its manifest lists (regression table).

Each case failed before per-file manifests: a stray ``zz.safetensors`` was merged into the
weights, a deleted ``quasar.json`` turned the artifact into a "float" checkpoint running int8
weights as float, exports carried no checksums, and symlinks leaked files into outputs.
"""

from __future__ import annotations

import json
import os
import shutil
import stat

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

import quasar_deploy
from quasar_deploy.artifact import MANIFEST, open_model_files
from quasar_deploy.cli import main
from quasar_deploy.errors import QuasarError
from quasar_deploy.exporters import export
from quasar_deploy.files import UNFINISHED, atomic_directory, copy_files, sha256_files
from quasar_deploy.integrity import EXPORT_MANIFEST

from .helpers import reseal

SCALE = "model.layers.1.mlp.up_proj.weight_scale"


def edit_manifest(directory, edit, manifest=MANIFEST):
    record = json.loads((directory / manifest).read_text())
    record = edit(record) or record
    (directory / manifest).write_text(json.dumps(record))


def edit_tensors(directory, edit, file="model.safetensors"):
    tensors = load_file(str(directory / file))
    edit(tensors)
    save_file(tensors, str(directory / file), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def artifact(tiny_qwen3, tmp_path_factory):
    out = tmp_path_factory.mktemp("integrity") / "w8a8"
    return quasar_deploy.calibrate(tiny_qwen3, out, num_samples=4, seq_len=32, progress=False).path


@pytest.fixture(scope="module")
def onnx_export(artifact, tmp_path_factory):
    pytest.importorskip("onnx")
    return export(artifact, "onnx", tmp_path_factory.mktemp("integrity-onnx") / "onnx")


@pytest.fixture
def copy(artifact, tmp_path):
    return shutil.copytree(artifact, tmp_path / "copy")


def stray_weights(d):
    save_file({SCALE: torch.full((160, 1), 10.0)}, str(d / "zz.safetensors"))


def drop_config_quantization(d):
    config = json.loads((d / "config.json").read_text())
    config.pop("quantization_config")
    (d / "config.json").write_text(json.dumps(config))
    (d / MANIFEST).unlink()


def format_1(record):
    record["format_version"] = 1
    record["weights_sha256"] = record.pop("files")["model.safetensors"]


def add_input_scale(d):
    edit_tensors(d, lambda t: t.__setitem__("model.layers.0.mlp.down_proj.input_scale", torch.tensor([0.01])))
    reseal(d)


def set_activation(mode):
    return lambda d: edit_manifest(d, lambda r: r["recipe"].__setitem__("scheme", {"activation": mode}))


ARTIFACT_DAMAGE = [
    ("stray zz.safetensors overriding a weight_scale", stray_weights, "zz.safetensors: not listed in quasar.json"),
    ("extra chat template", lambda d: (d / "chat_template.jinja").write_text("{{ x }}"), "chat_template.jinja: not listed in quasar.json"),
    ("missing tokenizer.json", lambda d: (d / "tokenizer.json").unlink(), "tokenizer.json: missing, but listed in quasar.json"),
    ("altered config.json", lambda d: (d / "config.json").write_text("{}"), "config.json: checksum mismatch"),
    ("altered weights", lambda d: edit_tensors(d, lambda t: t[SCALE].mul_(2)), "model.safetensors: checksum mismatch"),
    (
        "deleted quasar.json",
        lambda d: (d / MANIFEST).unlink(),
        "quantized (config.json has a quantization_config, quant_method 'compressed-tensors') but no quasar.json",
    ),
    ("deleted quasar.json and quantization_config", drop_config_quantization, "(model.layers.0.mlp.down_proj.weight is I8) but no"),
    ("quasar.json is []", lambda d: (d / MANIFEST).write_text("[]"), "quasar.json: expected a JSON object, not list"),
    ("quasar.json is not JSON", lambda d: (d / MANIFEST).write_text("{"), "quasar.json: not valid JSON"),
    ("no recipe", lambda d: edit_manifest(d, lambda r: r.pop("recipe") and None), "'recipe' is missing or not a JSON object"),
    ("quantized_layers not names", lambda d: edit_manifest(d, lambda r: r.__setitem__("quantized_layers", [[1]])), "must list layer names"),
    ("unknown activation", set_activation("per-channel"), "is not a W8A8 scheme this quasar-deploy runs"),
    ("format 1 manifest", lambda d: edit_manifest(d, format_1), "format 1, but this quasar-deploy reads format 2 only"),
    ("static without input_scale", set_activation("static"), "'static' activations, but model.layers.0.mlp.down_proj lacks an input_scale"),
    ("dynamic with input_scale", add_input_scale, "'dynamic' activations, but model.layers.0.mlp.down_proj has an input_scale"),
    ("files not a map", lambda d: edit_manifest(d, lambda r: r.__setitem__("files", ["model.safetensors"])), "'files' must map file names"),
    (
        "files names a path outside",
        lambda d: edit_manifest(d, lambda r: r["files"].__setitem__("../x", "0" * 64)),
        "'../x' is not a file name",
    ),
    ("unfinished marker", lambda d: (d / UNFINISHED).write_text("pid 1\n"), "an unfinished write"),
]


@pytest.mark.parametrize("name, damage, message", ARTIFACT_DAMAGE, ids=[c[0] for c in ARTIFACT_DAMAGE])
def test_a_damaged_artifact_is_refused_in_one_line(copy, name, damage, message):
    damage(copy)
    with pytest.raises(QuasarError) as error:
        open_model_files(copy)
    assert message in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("verify", ["model", "exact"])
def test_one_load_verifies_each_file_of_the_model_once(tiny_artifact, monkeypatch, verify):
    """``load`` opens the directory once and hands its ``ModelFiles`` down: "auto"'s memory check (which weighs ONNX Runtime
    here, finds it does not fit and takes cpu), the backend, the tokenizer and the stop ids verify nothing again."""
    from quasar_deploy import integrity
    from quasar_deploy.api import load
    from quasar_deploy.backends import registry
    from quasar_deploy.cpu import machine
    from quasar_deploy.files import verified_sha256

    verified: list[str] = []

    def counted(path):
        verified.append(path.name)
        return verified_sha256(path)

    monkeypatch.setattr(integrity, "verified_sha256", counted)
    monkeypatch.setattr(registry, "candidates", lambda needs=(), options=(): ["onnxruntime", "cpu"])
    monkeypatch.setattr(registry, "cpu_runs_better", lambda artifact: False)
    monkeypatch.setattr(machine, "memory_available", lambda: 0)
    assert load(tiny_artifact.path, verify=verify).backend == "cpu"
    assert sorted(verified) == sorted(tiny_artifact.listed)  # the float source of exact mode has no manifest


def test_the_weights_of_a_stray_file_never_load(copy):
    """Before: the stray file's weight_scale silently replaced the artifact's."""
    stray_weights(copy)
    with pytest.raises(QuasarError, match="not listed"):
        open_model_files(copy)
    (copy / "zz.safetensors").unlink()
    assert torch.equal(open_model_files(copy).checkpoint.tensor(SCALE), load_file(copy / "model.safetensors")[SCALE])


def test_the_manifest_lists_every_file_written(artifact):
    record = json.loads((artifact / MANIFEST).read_text())
    assert record["format_version"] == 2 and "weights_sha256" not in record
    on_disk = sorted(p.name for p in artifact.iterdir() if p.name != MANIFEST)
    assert sorted(record["files"]) == on_disk
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(record["files"])
    assert all(record["files"][name] == sha256_files(artifact / name) for name in on_disk)


def test_documentation_files_may_be_added(copy):
    (copy / "README.md").write_text("# my model\n")
    assert open_model_files(copy).is_artifact


def test_calibrate_refuses_quantized_inputs(artifact, onnx_export, tmp_path):
    npu = export(artifact, "npu", tmp_path / "npu")
    stripped = shutil.copytree(artifact, tmp_path / "stripped")
    (stripped / MANIFEST).unlink()
    cases = [(artifact, "already a W8A8 artifact"), (stripped, "but no quasar.json"), (npu, "an export (quasar-export.json)")]
    cases.append((onnx_export, "an export (quasar-export.json)"))
    for source, message in cases:
        result = CliRunner().invoke(main, ["calibrate", str(source), "-o", str(tmp_path / "out")])
        assert result.exit_code == 1 and message in result.output and "Traceback" not in result.output, result.output
    assert not (tmp_path / "out").exists()


def test_deleting_the_manifest_names_other_tools_checkpoints(copy):
    (copy / MANIFEST).unlink()
    with pytest.raises(QuasarError, match="runs only the W8A8 artifacts it writes, not other tools' compressed-tensors"):
        open_model_files(copy)


# exports


def test_export_manifests_list_every_file_written(artifact, onnx_export, tmp_path):
    npu = export(artifact, "npu", tmp_path / "npu")
    for directory, target in ((onnx_export, "onnx"), (npu, "npu")):
        record = json.loads((directory / EXPORT_MANIFEST).read_text())
        assert record["target"] == target and record["source"] == str(artifact)
        on_disk = sorted(p.name for p in directory.iterdir() if p.name != EXPORT_MANIFEST)
        assert sorted(record["files"]) == on_disk and all(record["files"][n] == sha256_files(directory / n) for n in on_disk)


ONNX_DAMAGE = [
    ("extra file", lambda d: (d / "model2.onnx").write_bytes(b"x"), "model2.onnx: not listed in quasar-export.json"),
    ("missing tokenizer", lambda d: (d / "tokenizer.json").unlink(), "tokenizer.json: missing, but listed in quasar-export.json"),
    ("altered graph", lambda d: (d / "model.onnx").write_bytes((d / "model.onnx").read_bytes()[:-1]), "model.onnx: checksum mismatch"),
    ("altered sidecar", lambda d: (d / "genai_config.json").write_text("{}"), "genai_config.json: checksum mismatch"),
    ("no manifest", lambda d: (d / EXPORT_MANIFEST).unlink(), "no quasar-export.json"),
    ("another target", lambda d: edit_manifest(d, lambda r: r.__setitem__("target", "npu"), EXPORT_MANIFEST), "a 'npu' export, not 'onnx'"),
    ("manifest is []", lambda d: (d / EXPORT_MANIFEST).write_text("[]"), "expected a JSON object, not list"),
    ("unfinished marker", lambda d: (d / UNFINISHED).write_text("pid 1\n"), "an unfinished write"),
]


@pytest.mark.parametrize("name, damage, message", ONNX_DAMAGE, ids=[c[0] for c in ONNX_DAMAGE])
def test_a_damaged_onnx_export_is_refused_in_one_line(onnx_export, tmp_path, name, damage, message):
    from quasar_deploy.backends.onnxruntime import load_onnx_export

    copy = shutil.copytree(onnx_export, tmp_path / "copy")
    damage(copy)
    with pytest.raises(QuasarError) as error:
        load_onnx_export(copy, threads=1)
    assert message in str(error.value) and "\n" not in str(error.value)


# symlinks and modes


def test_symlinks_out_of_the_input_are_not_copied(tiny_qwen3, tmp_path, capfd):
    secret = tmp_path / "secret.txt"
    secret.write_text("not part of any model")
    source = shutil.copytree(tiny_qwen3, tmp_path / "model")
    (source / "chat_template.jinja").symlink_to(secret)
    with pytest.raises(QuasarError, match="chat_template.jinja: a symbolic link out of"):  # its tokenizer would read it
        quasar_deploy.calibrate(source, tmp_path / "w8a8", num_samples=2, seq_len=16, progress=False)
    assert not (tmp_path / "w8a8").exists()
    exported = export(source, "onnx", tmp_path / "onnx", precision="float") if _has_onnx() else None
    assert exported is None or not (exported / "chat_template.jinja").exists()
    assert exported is None or "not copying chat_template.jinja: " in capfd.readouterr().err


def _has_onnx() -> bool:
    try:
        import onnx  # noqa: F401
    except ImportError:
        return False
    return True


def test_copy_files_takes_regular_files_and_links_that_stay_inside(tmp_path, capfd):
    cache = tmp_path / "models--org--m"
    source, target = cache / "snapshots" / "abc", tmp_path / "out"
    source.mkdir(parents=True)
    (cache / "blobs").mkdir()
    target.mkdir()
    (cache / "blobs" / "123").write_text("hub blob")
    (source / "tokenizer.json").symlink_to("../../blobs/123")  # the Hugging Face hub cache layout
    (source / "vocab.json").write_text("{}")
    (source / "merges.txt").symlink_to("vocab.json")
    (source / "chat_template.jinja").symlink_to("/etc/hostname")
    (source / "tokenizer_config.json").mkdir()
    copy_files(source, target)
    assert sorted(p.name for p in target.iterdir()) == ["merges.txt", "tokenizer.json", "vocab.json"]
    assert not any(p.is_symlink() for p in target.iterdir()) and (target / "tokenizer.json").read_text() == "hub blob"
    err = capfd.readouterr().err
    assert "not copying" in err and "chat_template.jinja" in err and "tokenizer_config.json" in err


def test_written_files_get_the_modes_of_a_plain_write(tmp_path):
    old = os.umask(0o027)
    try:
        with atomic_directory(tmp_path / "out") as tmp:
            save_file({"a": torch.zeros(2)}, str(tmp / "model.safetensors"))  # safetensors creates 0600
            (tmp / "sub").mkdir(mode=0o700)
            (tmp / "sub" / "f").write_text("x")
    finally:
        os.umask(old)
    out = tmp_path / "out"
    assert stat.S_IMODE(out.stat().st_mode) == 0o750 and stat.S_IMODE((out / "sub").stat().st_mode) == 0o750
    assert stat.S_IMODE((out / "model.safetensors").stat().st_mode) == 0o640
    assert stat.S_IMODE((out / "sub" / "f").stat().st_mode) == 0o640
    assert not (out / UNFINISHED).exists()


def test_artifact_modes_follow_the_umask(artifact):
    mask = os.umask(0)
    os.umask(mask)
    assert stat.S_IMODE(artifact.stat().st_mode) == 0o777 & ~mask
    assert {stat.S_IMODE(p.stat().st_mode) for p in artifact.iterdir()} == {0o666 & ~mask}
