"""The managed cache: entries keyed by their source's content, listed (orphans named), cleared, capped with
least-recently-used eviction, and an export refused up front where the disk has no room for it."""

from __future__ import annotations

import json
import shutil
import time
from collections import namedtuple

import pytest
from click.testing import CliRunner

from quasar_deploy import cache
from quasar_deploy.artifact import open_model_files
from quasar_deploy.backends import onnx_export_cache
from quasar_deploy.cli import main
from quasar_deploy.errors import QuasarError

from .helpers import assert_one_line_error, copy_dir

Usage = namedtuple("Usage", "total used free")


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("QUASAR_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("QUASAR_CACHE_MAX", raising=False)
    return tmp_path / "cache"


def _entry(root, name: str, size: int, last_used: float, monkeypatch) -> None:
    """A cache entry of ``size`` bytes, last used at ``last_used``."""
    (root / name).mkdir(parents=True)
    (root / name / "data").write_bytes(b"x" * size)
    with monkeypatch.context() as patch:
        patch.setattr(time, "time", lambda: last_used)
        cache.used(root / name)


def _names(root) -> list[str]:
    return [e.path.name for e in cache.entries(root)]


def test_a_recreated_source_finds_its_export_and_a_deleted_one_is_orphaned(tiny_artifact, tiny_qwen3, tmp_path, empty_cache, capfd):
    pytest.importorskip("onnxruntime")
    first = copy_dir(tiny_artifact.path, tmp_path, "first")
    export = onnx_export_cache.cached_onnx_export(open_model_files(first), progress=False)
    assert "exporting it to" in capfd.readouterr().err
    shutil.rmtree(first)
    listed = json.loads(CliRunner().invoke(main, ["cache", "list", "--json"]).output)["entries"]
    assert [(e["name"], e["orphaned"], e["sources"]) for e in listed] == [(export.name, True, [str(first)])]
    assert "orphaned: " + str(first) + " gone" in CliRunner().invoke(main, ["cache", "list"]).output
    again = copy_dir(tiny_artifact.path, tmp_path, "again")  # a new temporary directory of the same artifact
    assert onnx_export_cache.cached_onnx_export(open_model_files(again), progress=False) == export
    assert "exporting" not in capfd.readouterr().err
    assert not cache.entries()[0].orphaned  # its new source is there
    # a checkpoint: its files' bytes, not their times or place, name it
    a, b = copy_dir(tiny_qwen3, tmp_path, "a"), copy_dir(tiny_qwen3, tmp_path, "b")
    assert onnx_export_cache.content_key(a) == onnx_export_cache.content_key(b)
    weights = next(b.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    assert onnx_export_cache.content_key(a) != onnx_export_cache.content_key(b)


def test_least_recently_used_entries_are_evicted_to_fit_the_limit(empty_cache, monkeypatch):
    _entry(empty_cache, "old", 400, 1000.0, monkeypatch)
    _entry(empty_cache, "recent", 400, 3000.0, monkeypatch)
    _entry(empty_cache, "middle", 400, 2000.0, monkeypatch)
    assert _names(empty_cache) == ["old", "middle", "recent"]
    monkeypatch.setenv("QUASAR_CACHE_MAX", "1500")
    assert cache.make_room(200) == []  # 1,200 + 200 fit
    evicted = cache.make_room(500)
    assert [e.path.name for e in evicted] == ["old"] and _names(empty_cache) == ["middle", "recent"]
    assert not (empty_cache / cache.INDEX / "old.json").exists()
    evicted = cache.make_room(1200, keep=((empty_cache / "middle").resolve(),))  # a source in the cache is never evicted
    assert [e.path.name for e in evicted] == ["recent"] and _names(empty_cache) == ["middle"]
    with pytest.raises(QuasarError, match=r"needs 0.0 GB for this, over its limit of 0.0 GB \(raise QUASAR_CACHE_MAX\)"):
        cache.make_room(2000)


def test_an_export_evicts_to_fit_and_is_refused_without_disk_space(tiny_artifact, empty_cache, monkeypatch):
    pytest.importorskip("onnxruntime")
    need = onnx_export_cache.export_bytes(tiny_artifact)
    _entry(empty_cache, "stale", need, 1000.0, monkeypatch)
    monkeypatch.setenv("QUASAR_CACHE_MAX", str(int(need * 1.5)))
    path = onnx_export_cache.cached_onnx_export(tiny_artifact, progress=False)
    assert _names(empty_cache) == [path.name]
    assert cache.entries()[0].bytes == pytest.approx(need, rel=0.2)  # the estimate the check makes is the export's size
    shutil.rmtree(path)
    monkeypatch.setattr(shutil, "disk_usage", lambda _: Usage(10**12, 10**12 - need // 2, need // 2))
    with pytest.raises(QuasarError, match=rf"not enough disk space in {empty_cache}: this needs [\d.]+ GB, [\d.]+ GB free"):
        onnx_export_cache.cached_onnx_export(tiny_artifact, progress=False)
    assert not path.exists()


def test_the_default_limit_is_a_share_of_the_disk(empty_cache, monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage", lambda _: Usage(400 * 10**9, 0, 400 * 10**9))
    assert cache.size_limit() == 100 * 10**9
    monkeypatch.setenv("QUASAR_CACHE_MAX", "20G")
    assert cache.size_limit() == 20 * 10**9
    monkeypatch.setenv("QUASAR_CACHE_MAX", "lots")
    with pytest.raises(QuasarError, match="not a size: 'lots'"):
        cache.size_limit()


def test_clear_removes_everything_or_what_is_older_than_an_age(empty_cache, monkeypatch):
    _entry(empty_cache, "old", 10, time.time() - 3 * 86400, monkeypatch)
    _entry(empty_cache, "new", 10, time.time() - 3600, monkeypatch)
    result = CliRunner().invoke(main, ["cache", "clear", "--older-than", "2d"])
    assert result.exit_code == 0 and result.output == "removed 1 entries, 0.00 GB\n"
    assert _names(empty_cache) == ["new"]
    assert_one_line_error(CliRunner().invoke(main, ["cache", "clear", "--older-than", "soon"]), "not an age: 'soon'", only_line=True)
    assert CliRunner().invoke(main, ["cache", "clear"]).output == "removed 1 entries, 0.00 GB\n"
    assert _names(empty_cache) == []


def test_path_list_and_doctor_show_the_cache(empty_cache, monkeypatch):
    assert CliRunner().invoke(main, ["cache", "path"]).output == f"{empty_cache}\n"
    CliRunner().invoke(main, ["doctor", "--json"])  # kernels this process had not built yet go into the empty cache once
    shutil.rmtree(empty_cache, ignore_errors=True)  # (then stay loaded): the entries below are the test's alone
    _entry(empty_cache, "a", 3000, 1000.0, monkeypatch)
    _entry(empty_cache, "b", 2000, 2000.0, monkeypatch)
    monkeypatch.setenv("QUASAR_CACHE_MAX", "1G")
    lines = CliRunner().invoke(main, ["cache", "list"]).output.splitlines()
    assert [line.split()[-1] for line in lines[:2]] == ["a", "b"]  # least recently used first
    assert lines[-1] == f"0.00 GB in 2 entries at {empty_cache} (limit 1.0 GB)"
    info = json.loads(CliRunner().invoke(main, ["doctor", "--json"]).output)["cache"]
    assert info == {"path": str(empty_cache), "bytes": 5000, "entries": 2, "orphaned": 0, "limit": 10**9}
    assert "cache          0.00 GB in 2 entries (0 orphaned), limit 1.0 GB" in CliRunner().invoke(main, ["doctor"]).output
