"""files.py: the guarantees every writer relies on (no overwrite, nothing left behind, stable hashes, one-line errors)."""

import hashlib
import subprocess
import sys

import pytest

from quasar_deploy import QuasarError
from quasar_deploy.files import atomic_directory, copy_files, first_line, require_new, sha256_files


def test_require_new_refuses_an_existing_path_naming_the_flag(tmp_path):
    assert require_new(str(tmp_path / "new")) == tmp_path / "new"
    (tmp_path / "taken").write_text("user data")
    with pytest.raises(QuasarError, match=r"taken: already exists; choose a new --output or remove it first$"):
        require_new(tmp_path / "taken")
    assert (tmp_path / "taken").read_text() == "user data"


def test_atomic_directory_appears_whole_on_success(tmp_path):
    output = tmp_path / "deep" / "out"
    with atomic_directory(output) as tmp:
        (tmp / "a.txt").write_text("a")
        assert not output.exists()
    assert (output / "a.txt").read_text() == "a"
    assert [p.name for p in output.parent.iterdir()] == ["out"]


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_atomic_directory_leaves_nothing_on_failure(tmp_path, error):
    with pytest.raises(error):
        with atomic_directory(tmp_path / "out") as tmp:
            (tmp / "half-written").write_text("x")
            raise error
    assert list(tmp_path.iterdir()) == []


def test_atomic_directory_never_replaces_an_existing_output(tmp_path):
    (tmp_path / "out").mkdir()
    with pytest.raises(QuasarError, match="already exists"):
        with atomic_directory(tmp_path / "out"):
            pytest.fail("the body must not run")
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_copy_files_copies_only_what_the_source_has(tmp_path):
    source, target = tmp_path / "src", tmp_path / "dst"
    source.mkdir()
    target.mkdir()
    (source / "tokenizer.json").write_text("{}")
    (source / "model.safetensors").write_text("weights")
    copy_files(source, target)
    assert [p.name for p in target.iterdir()] == ["tokenizer.json"]


def test_sha256_files_hashes_the_concatenation(tmp_path):
    (tmp_path / "a").write_bytes(b"config")
    (tmp_path / "b").write_bytes(b"x" * (5 << 20))  # spans several read blocks
    assert sha256_files(tmp_path / "a") == hashlib.sha256(b"config").hexdigest()
    assert sha256_files(tmp_path / "a", tmp_path / "b") == hashlib.sha256(b"config" + b"x" * (5 << 20)).hexdigest()


def test_first_line():
    assert first_line(ValueError("\n  bad file\nTraceback (most recent call last): ...\n")) == "bad file"
    assert first_line(OSError()) == "OSError"


def test_files_does_not_import_torch():
    code = "import sys, quasar_deploy.files; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
