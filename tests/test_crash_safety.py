"""Crash leftovers and durability: a killed write never loads, the next write removes it, a live one is never touched.

The fault-injection tests run the real CLI in a subprocess and SIGKILL it at chosen points,
through a driver that wraps one package function (the package has no test hooks).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import quasar_deploy
from quasar_deploy.artifact import open_model_files
from quasar_deploy.errors import QuasarError
from quasar_deploy.exporters import export
from quasar_deploy.files import UNFINISHED, atomic_directory, remove_stale_writes

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
RECIPE = dict(num_samples=4, seq_len=32)
PROMPT = "def fibonacci(n):"

# argv: point output cli-args... ; point "module:function" (or "module:Class.method") dies right after it returns,
# "rename" dies instead of the rename that would publish ``output``
DRIVER = textwrap.dedent(
    """
    import importlib, os, signal, sys
    from pathlib import Path

    point, output, argv = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]

    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    if point == "rename":
        replace = os.replace
        os.replace = lambda src, dst: die() if Path(dst) == output else replace(src, dst)
    else:
        module, path = point.split(":")
        owner = importlib.import_module(module)
        *parents, name = path.split(".")
        for parent in parents:
            owner = getattr(owner, parent)
        original = getattr(owner, name)

        def killed_after(*args, **kwargs):
            original(*args, **kwargs)
            die()

        setattr(owner, name, killed_after)

    from quasar_deploy.cli import main

    main(argv)
    """
)

WRITER = textwrap.dedent(
    """
    import os, shutil, signal, sys
    from pathlib import Path
    from quasar_deploy.files import atomic_directory

    source, output, mode = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    with atomic_directory(output) as tmp:
        for name in ("config.json", "model.safetensors", "tokenizer.json"):
            shutil.copyfile(source / name, tmp / name)
        print(tmp, flush=True)
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        sys.stdin.readline()
    """
)


def run_killed(tmp_path, point, output, *args):
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    result = subprocess.run([sys.executable, str(driver), point, str(output), *map(str, args)], env=ENV, capture_output=True, text=True)
    assert result.returncode == -signal.SIGKILL, result.stderr[-2000:]


def leftovers(parent):
    return sorted(parent.glob(".tmp-*"))


def greedy_tokens(path, backend="cpu"):
    return quasar_deploy.load(path, backend=backend).generate(PROMPT, max_new_tokens=12, draft="none").tokens


def listed_files(path, manifest):
    return json.loads((path / manifest).read_text())["files"]


@pytest.fixture(scope="module")
def reference(tiny_qwen3, tmp_path_factory):
    """An artifact and its ONNX export written without interruption: what every rerun must reproduce."""
    root = tmp_path_factory.mktemp("crash-reference")
    artifact = quasar_deploy.calibrate(tiny_qwen3, root / "w8a8", progress=False, **RECIPE).path
    onnx = export(artifact, "onnx", root / "onnx") if _has_onnx() else None
    return artifact, onnx


def _has_onnx() -> bool:
    try:
        import onnx  # noqa: F401
        import onnxruntime  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.slow
@pytest.mark.parametrize("point", ["quasar_deploy.shards:ShardWriter.close", "rename"], ids=["after-weights", "before-rename"])
def test_killed_calibrate(tiny_qwen3, reference, tmp_path, capfd, point):
    output = tmp_path / "w8a8"
    run_killed(tmp_path, point, output, "calibrate", tiny_qwen3, "-o", output, "--num-samples", 4, "--seq-len", 32)
    assert not output.exists()
    [leftover] = leftovers(tmp_path)
    assert (leftover / UNFINISHED).exists() and (leftover / "model.safetensors").exists()
    with pytest.raises(QuasarError, match="an unfinished write"):
        open_model_files(leftover)

    quasar_deploy.calibrate(tiny_qwen3, output, progress=False, **RECIPE)
    assert leftovers(tmp_path) == [] and f"removed {leftover}, left by an interrupted write" in capfd.readouterr().err
    assert listed_files(output, "quasar.json") == listed_files(reference[0], "quasar.json")
    assert greedy_tokens(output) == greedy_tokens(reference[0])


@pytest.mark.slow
@pytest.mark.parametrize("point", ["quasar_deploy.exporters.onnx:save_graph", "rename"], ids=["after-graph", "before-rename"])
def test_killed_onnx_export(reference, tmp_path, capfd, point):
    from quasar_deploy.backends.onnxruntime import read_config

    artifact, onnx = reference
    if onnx is None:
        pytest.skip("onnx and onnxruntime are not installed")
    output = tmp_path / "onnx"
    run_killed(tmp_path, point, output, "export", artifact, "--target", "onnx", "-o", output)
    assert not output.exists()
    [leftover] = leftovers(tmp_path)
    assert (leftover / UNFINISHED).exists() and (leftover / "model.onnx").exists()
    with pytest.raises(QuasarError, match="an unfinished write"):
        read_config(leftover)

    export(artifact, "onnx", output)
    assert leftovers(tmp_path) == [] and "left by an interrupted write" in capfd.readouterr().err
    assert listed_files(output, "quasar-export.json") == listed_files(onnx, "quasar-export.json")
    assert greedy_tokens(output, "onnxruntime") == greedy_tokens(onnx, "onnxruntime") == greedy_tokens(artifact)


def start_writer(tiny_qwen3, output, mode):
    command = [sys.executable, "-c", WRITER, str(tiny_qwen3), str(output), mode]
    writer = subprocess.Popen(command, env=ENV, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    return writer, Path(writer.stdout.readline().strip())


def test_a_killed_writer_leaves_a_refused_directory_that_the_next_write_removes(tiny_qwen3, tmp_path, capfd):
    writer, leftover = start_writer(tiny_qwen3, tmp_path / "out", "kill")
    assert writer.wait() == -signal.SIGKILL
    assert leftovers(tmp_path) == [leftover] and not (tmp_path / "out").exists()
    with pytest.raises(QuasarError, match=r"an unfinished write .*; remove it and run again$"):
        open_model_files(leftover)  # before: it held config and weights, and loaded as a float checkpoint

    with atomic_directory(tmp_path / "next") as tmp:
        (tmp / "a").write_text("a")
    assert leftovers(tmp_path) == [] and (tmp_path / "next" / "a").exists()
    assert f"warning: removed {leftover}" in capfd.readouterr().err


def test_a_live_writer_is_never_removed(tiny_qwen3, tmp_path):
    writer, live = start_writer(tiny_qwen3, tmp_path / "out", "wait")
    try:
        assert remove_stale_writes(tmp_path) == []
        with atomic_directory(tmp_path / "mine") as tmp:
            (tmp / "a").write_text("a")
        assert live.is_dir() and (live / UNFINISHED).exists()
    finally:
        writer.communicate("go\n", timeout=60)
    assert writer.returncode == 0 and not live.exists()
    assert not (tmp_path / "out" / UNFINISHED).exists() and open_model_files(tmp_path / "out").is_artifact is False


def test_directories_without_a_marker_are_left_alone(tmp_path):
    (tmp_path / ".tmp-someone-else").mkdir()
    (tmp_path / ".tmp-someone-else" / "data").write_text("x")
    with atomic_directory(tmp_path / "out"):
        pass
    assert (tmp_path / ".tmp-someone-else" / "data").exists()


def test_files_and_directories_are_fsynced_before_the_rename(tmp_path, monkeypatch):
    events = []
    fsync, replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))) or fsync(fd))
    monkeypatch.setattr(os, "replace", lambda src, dst: events.append(("replace", str(dst))) or replace(src, dst))
    output = tmp_path / "out"
    with atomic_directory(output) as tmp:
        (tmp / "sub").mkdir()
        (tmp / "model.safetensors").write_bytes(b"w" * 100)
        (tmp / "sub" / "config.json").write_text("{}")
    published = events.index(("replace", str(output)))
    before = {path for kind, path in events[:published] if kind == "fsync"}
    assert {str(tmp / "model.safetensors"), str(tmp / "sub" / "config.json"), str(tmp / "sub"), str(tmp), str(tmp / UNFINISHED)} <= before
    after = {path for kind, path in events[published:] if kind == "fsync"}
    assert {str(output), str(tmp_path)} <= after


def test_an_unfinished_copy_is_refused_even_when_complete(tiny_qwen3, tmp_path):
    copy = shutil.copytree(tiny_qwen3, tmp_path / "copy")
    (copy / UNFINISHED).write_text("pid 1\n")
    with pytest.raises(QuasarError, match="an unfinished write"):
        open_model_files(copy)
