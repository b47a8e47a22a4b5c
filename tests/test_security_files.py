"""Nothing outside a model directory is read, and nothing inside is parsed before it is verified (regression table).

Each class failed before, as the security review found it (issue 24): a resealed symlink out of the artifact
(``chat_template.jinja -> /etc/passwd``) was served; the ONNX route used a tampered tokenizer once the artifact's
export was cached; a bad safetensors header or a stray shard got a parser's message instead of "checksum mismatch"
or "not listed"; a 256-character name in ``files`` surfaced as ``[Errno 36]``.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
from click.testing import CliRunner

from quasar_deploy.api import load
from quasar_deploy.artifact import open_model_files
from quasar_deploy.checkpoint import Checkpoint
from quasar_deploy.cli import main
from quasar_deploy.errors import QuasarError
from quasar_deploy.files import check_name
from quasar_deploy.integrity import EXPORT_MANIFEST, MANIFEST, listed_files
from quasar_deploy.tokenizer import load_tokenizer, read_tokenizer

from .helpers import assert_one_line_error, copy_dir, reseal

SECRET = "root:x:0:0:root:/root:/bin/bash\n" * 20


def one_line(error: pytest.ExceptionInfo, text: str) -> None:
    assert text in str(error.value) and "\n" not in str(error.value), str(error.value)


@pytest.fixture
def secret(tmp_path) -> Path:
    """A file outside every model directory, standing for /etc/passwd."""
    path = tmp_path / "outside" / "passwd"
    path.parent.mkdir()
    path.write_text(SECRET)
    return path


def link(directory: Path, name: str, target: Path) -> None:
    (directory / name).unlink(missing_ok=True)
    (directory / name).symlink_to(target)


# --- links out of the directory: refused wherever the file is read, however carefully the manifest is resealed ---


def chat_template_out(d, secret):
    link(d, "chat_template.jinja", secret)


def tokenizer_out(d, secret):
    (secret.parent / "tokenizer.json").write_bytes((d / "tokenizer.json").read_bytes())
    link(d, "tokenizer.json", secret.parent / "tokenizer.json")


def weights_out(d, secret):
    (secret.parent / "w.safetensors").write_bytes((d / "model.safetensors").read_bytes())
    link(d, "model.safetensors", secret.parent / "w.safetensors")


def config_out(d, secret):
    (secret.parent / "config.json").write_bytes((d / "config.json").read_bytes())
    link(d, "config.json", secret.parent / "config.json")


def generation_config_out(d, secret):
    (secret.parent / "g.json").write_text('{"eos_token_id": 1}')
    link(d, "generation_config.json", secret.parent / "g.json")


LINKS_OUT = [chat_template_out, tokenizer_out, weights_out, config_out, generation_config_out]


@pytest.mark.parametrize("damage", LINKS_OUT, ids=[f.__name__ for f in LINKS_OUT])
def test_a_resealed_link_out_of_an_artifact_is_refused(naive_artifact, tmp_path, secret, damage):
    artifact = copy_dir(naive_artifact, tmp_path)
    damage(artifact, secret)
    reseal(artifact)  # the attacker updates quasar.json: the checksums alone would let it through
    for read in (open_model_files, lambda d: load(d, backend="cpu")):  # its tokenizer and stop ids are read once it is opened
        with pytest.raises(QuasarError) as error:
            read(artifact)
        one_line(error, "a symbolic link out of")


@pytest.mark.parametrize("damage", LINKS_OUT, ids=[f.__name__ for f in LINKS_OUT])
def test_a_link_out_of_a_checkpoint_is_refused(tiny_qwen3, tmp_path, secret, damage):
    checkpoint = copy_dir(tiny_qwen3, tmp_path)
    damage(checkpoint, secret)
    with pytest.raises(QuasarError) as error:
        load(checkpoint, backend="cpu")
    one_line(error, "a symbolic link out of")
    if damage in (weights_out, config_out):  # what the checkpoint reader itself opens
        with pytest.raises(QuasarError, match="a symbolic link out of"):
            Checkpoint(checkpoint)


def test_a_link_out_anywhere_in_a_checkpoint_keeps_its_tokenizer_from_loading(tiny_qwen3, tmp_path, secret):
    """transformers reads more than the files we name (additional_chat_templates/): every link in the tree is checked."""
    checkpoint = copy_dir(tiny_qwen3, tmp_path)
    (checkpoint / "additional_chat_templates").mkdir()
    link(checkpoint / "additional_chat_templates", "tool_use.jinja", secret)
    with pytest.raises(QuasarError) as error:
        load_tokenizer(open_model_files(checkpoint))
    one_line(error, "a symbolic link out of")


def test_an_artifact_subdirectory_never_reaches_the_tokenizer(naive_artifact, tmp_path):
    """Subdirectories are not listed; the tokenizer is loaded from the verified files only, so one cannot add a template."""
    artifact = copy_dir(naive_artifact, tmp_path)
    (artifact / "additional_chat_templates").mkdir()
    (artifact / "additional_chat_templates" / "evil.jinja").write_text("{{ 'injected' }}")
    tokenizer = load_tokenizer(open_model_files(artifact))
    assert "injected" not in json.dumps(getattr(tokenizer, "chat_template", None) or {})


def test_an_onnx_export_with_a_link_out_is_refused(tiny_onnx, tmp_path, secret):
    export = copy_dir(tiny_onnx, tmp_path)
    tokenizer_out(export, secret)
    reseal(export, EXPORT_MANIFEST)
    for read in (lambda d: read_tokenizer(d, listed_files(d)), lambda d: load(d, backend="onnxruntime")):
        with pytest.raises(QuasarError) as error:
            read(export)
        one_line(error, "a symbolic link out of")


def test_links_that_stay_inside_are_followed_and_verified(naive_artifact, tmp_path):
    """The decision for inside links: allowed (what they reach is the directory's own file, checksummed as such)."""
    artifact = copy_dir(naive_artifact, tmp_path)
    (artifact / "tokenizer.json").rename(artifact / "tok.json")
    link(artifact, "tokenizer.json", Path("tok.json"))
    reseal(artifact)
    assert open_model_files(artifact).is_artifact and len(load_tokenizer(open_model_files(artifact))) > 0
    (artifact / "tok.json").write_text("{}")  # the target's bytes are what the checksum covers
    with pytest.raises(QuasarError, match="checksum mismatch"):
        open_model_files(artifact)


@pytest.mark.parametrize("kind", ["fifo", "directory", "dangling link"])
def test_a_listed_name_that_is_not_a_regular_file_is_refused_without_reading(naive_artifact, tmp_path, kind):
    """A FIFO would hang the checksum pass forever; each is one line instead."""
    artifact = copy_dir(naive_artifact, tmp_path)
    target = artifact / "generation_config.json"
    target.unlink()
    {"fifo": lambda: os.mkfifo(target), "directory": target.mkdir, "dangling link": lambda: target.symlink_to("nowhere.json")}[kind]()
    with pytest.raises(QuasarError) as error:
        open_model_files(artifact)
    assert "generation_config.json" in str(error.value) and "\n" not in str(error.value)


# --- checksums before any parser reads a byte ---


def corrupt_header_offset(d):
    data = bytearray((d / "model.safetensors").read_bytes())
    size = struct.unpack("<Q", data[:8])[0]
    header = data[8 : 8 + size].replace(b'"data_offsets":[0,', b'"data_offsets":[9,', 1)
    (d / "model.safetensors").write_bytes(bytes(data[:8] + header + data[8 + size :]))


def garbage_shard(d):
    (d / "zz.safetensors").write_bytes(b"\x01\x00")


def garbage_index(d):
    (d / "model.safetensors.index.json").write_text("[[[")


def garbage_config(d):
    (d / "config.json").write_text("{not json")


def huge_header_length(d):
    data = bytearray((d / "model.safetensors").read_bytes())
    data[:8] = struct.pack("<Q", 1 << 60)
    (d / "model.safetensors").write_bytes(bytes(data))


BEFORE_PARSING = [
    (corrupt_header_offset, "model.safetensors: checksum mismatch"),
    (huge_header_length, "model.safetensors: checksum mismatch"),
    (garbage_shard, "zz.safetensors: not listed in quasar.json"),
    (garbage_index, "model.safetensors.index.json: not listed in quasar.json"),
    (garbage_config, "config.json: checksum mismatch"),
]


@pytest.mark.parametrize("damage, message", BEFORE_PARSING, ids=[f.__name__ for f, _ in BEFORE_PARSING])
def test_checksums_and_the_listing_come_before_any_parser(naive_artifact, tmp_path, damage, message):
    artifact = copy_dir(naive_artifact, tmp_path)
    damage(artifact)
    with pytest.raises(QuasarError) as error:
        open_model_files(artifact)
    one_line(error, message)
    result = CliRunner().invoke(main, ["generate", str(artifact), "--prompt", "hi", "--max-new-tokens", "2"])
    assert_one_line_error(result, message)


def test_an_export_is_verified_before_its_description_is_parsed(tiny_onnx, tmp_path):
    export = copy_dir(tiny_onnx, tmp_path)
    (export / "genai_config.json").write_text("{")
    with pytest.raises(QuasarError) as error:
        load(export, backend="onnxruntime")
    one_line(error, "genai_config.json: checksum mismatch")


# --- the auto/ONNX route verifies its source, and its cached export is the one built from that source ---


def swap_token_ids(d):
    tokenizer = json.loads((d / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[10:12]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (d / "tokenizer.json").write_text(json.dumps(tokenizer))


TAMPER_AFTER_EXPORT = [
    (swap_token_ids, "tokenizer.json: checksum mismatch"),
    (lambda d: (d / "chat_template.jinja").write_text("{{ messages }}"), "chat_template.jinja: not listed"),
    (lambda d: (d / "generation_config.json").write_text('{"eos_token_id": 5}'), "generation_config.json: checksum mismatch"),
    (corrupt_header_offset, "model.safetensors: checksum mismatch"),
]


@pytest.mark.parametrize("damage, message", TAMPER_AFTER_EXPORT, ids=["tokenizer", "template", "generation", "weights"])
def test_the_onnx_route_verifies_the_source_of_a_cached_export(naive_artifact, tmp_path, monkeypatch, damage, message):
    monkeypatch.setenv("QUASAR_CACHE", str(tmp_path / "cache"))
    artifact = copy_dir(naive_artifact, tmp_path)
    load(artifact, backend="onnxruntime")  # exports it to the cache
    damage(artifact)
    with pytest.raises(QuasarError) as error:
        load(artifact, backend="onnxruntime")
    one_line(error, message)
    result = CliRunner().invoke(main, ["generate", str(artifact), "--prompt", "hi", "--max-new-tokens", "2"])  # auto
    assert_one_line_error(result, message)


def test_a_cached_export_built_from_another_artifact_is_made_again(naive_artifact, tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("QUASAR_CACHE", str(tmp_path / "cache"))
    artifact = copy_dir(naive_artifact, tmp_path)
    engine = load(artifact, backend="onnxruntime")
    expected = engine.generate([1, 2, 3], max_new_tokens=4, draft="none").tokens
    cached = next((tmp_path / "cache").glob("onnx-*"))
    config = json.loads((cached / "genai_config.json").read_text())
    config["quasar"]["source_manifest_sha256"] = "0" * 64
    (cached / "genai_config.json").write_text(json.dumps(config))
    reseal(cached, EXPORT_MANIFEST)  # a consistent export, but of another artifact
    capfd.readouterr()
    again = load(artifact, backend="onnxruntime")
    assert "exported from another artifact" in capfd.readouterr().err
    assert again.generate([1, 2, 3], max_new_tokens=4, draft="none").tokens == expected


# --- names: length and characters, one line ---

BAD_NAMES = ["x" * 256, "a" * 300 + ".json", "bad\nname", "nul\x00name", "back\\slash", "..", "", "dir/name"]


@pytest.mark.parametrize("name", BAD_NAMES, ids=range(len(BAD_NAMES)))
def test_a_bad_name_in_files_is_one_line(naive_artifact, tmp_path, name):
    artifact = copy_dir(naive_artifact, tmp_path)
    record = json.loads((artifact / MANIFEST).read_text())
    record["files"][name] = "0" * 64
    (artifact / MANIFEST).write_text(json.dumps(record))
    with pytest.raises(QuasarError) as error:
        open_model_files(artifact)
    assert "Errno" not in str(error.value) and "\n" not in str(error.value) and "quasar.json" in str(error.value)
    result = CliRunner().invoke(main, ["generate", str(artifact), "--prompt", "hi"])
    assert_one_line_error(result, "quasar.json")


def test_an_unlisted_file_with_an_odd_name_is_named_in_one_line(naive_artifact, tmp_path):
    artifact = copy_dir(naive_artifact, tmp_path)
    (artifact / "evil\nname.safetensors").write_bytes(b"x")
    with pytest.raises(QuasarError) as error:
        open_model_files(artifact)
    one_line(error, "not listed")


def test_check_name_accepts_plain_names():
    for name in ("model.safetensors", "model-00001-of-00002.safetensors", "é.json", "x" * 255):
        assert check_name(name, "here") == name
