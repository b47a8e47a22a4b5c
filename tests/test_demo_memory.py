"""The demo's memory: one backend's engines in memory at a time, and what it needs said (and checked) before it starts."""

import weakref

import pytest
from click.testing import CliRunner

from quasar_deploy.backends.registry import unavailable
from quasar_deploy.cli import main
from quasar_deploy.demo import needs as demo_needs_module
from quasar_deploy.demo import run
from quasar_deploy.demo.needs import DemoNeeds, check_needs
from quasar_deploy.errors import QuasarError

from .helpers import assert_one_line_error

needs_ort = pytest.mark.skipif(unavailable("onnxruntime") is not None, reason="onnxruntime is not installed")


@needs_ort
def test_the_demo_holds_one_backends_engines_at_a_time(tiny_qwen3, tiny_artifact, monkeypatch):
    """Two float engines of the 0.6B body would hold 3.6 GB: the float and W8A8 engines of one backend are measured
    together, and freed before the next backend's load."""
    alive: dict[int, str] = {}
    loads = []
    real_load = run.load

    def load(path, backend):
        engine = real_load(path, backend=backend)
        key = id(engine)
        loads.append((backend, sorted(alive.values())))  # what was still alive when this engine loaded
        alive[key] = backend
        weakref.finalize(engine, alive.pop, key)
        return engine

    monkeypatch.setattr(run, "load", load)
    streamed = []
    result = run._measure(tiny_qwen3, tiny_artifact.path, True, ["def f(x):", "import os"], 4, before=lambda e: streamed.append(sorted(e)))
    assert [backend for backend, _ in loads] == ["cpu", "cpu", "onnxruntime", "onnxruntime"]
    assert loads[2][1] == [] and loads[3][1] == ["onnxruntime"]  # the cpu engines were gone before ORT's loaded
    assert streamed == [["ngram-float", "ngram-w8a8"]]  # the sample streams once, on the first backend's engines
    modes = result["modes"]
    assert sorted(modes) == ["ngram-float", "ngram-float-ort", "ngram-w8a8", "ngram-w8a8-ort"]
    # each is compared with the fastest float mode of either backend on the same prompt, so no float mode beats it
    assert all(modes[m]["vs_best_float"] <= 1 + 1e-9 for m in ("ngram-float", "ngram-float-ort"))
    assert loads[1][1] == ["cpu"]


@pytest.mark.parametrize(
    "needs, available, free, message",
    [
        (
            DemoNeeds(memory=3 * 10**9, disk=0),
            2 * 10**9,
            10**12,
            "the demo needs ~3.0 GB of memory at its peak, this machine has 2.0 GB available",
        ),
        (DemoNeeds(memory=10**9, disk=4 * 10**9), 8 * 10**9, 10**9, "the demo's first run writes 4.0 GB to the cache"),
    ],
    ids=["memory", "disk"],
)
def test_a_machine_short_of_what_the_demo_needs_is_refused(needs, available, free, message):
    with pytest.raises(QuasarError, match=message):
        check_needs(needs, available, free)
    check_needs(needs, needs.memory, needs.disk)  # exactly enough is enough


def test_the_demo_command_refuses_in_one_line_before_writing_anything(tmp_path, monkeypatch):
    monkeypatch.setenv("QUASAR_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(demo_needs_module, "memory_available", lambda: 10**8)
    result = CliRunner().invoke(main, ["demo"])
    assert_one_line_error(result, "the demo needs ~")
    assert not (tmp_path / "cache").exists() or not any(p.name.startswith("demo-") for p in (tmp_path / "cache").iterdir())


def test_doctor_says_what_the_demo_needs(tmp_path, monkeypatch):
    monkeypatch.setenv("QUASAR_CACHE", str(tmp_path / "cache"))
    result = CliRunner().invoke(main, ["doctor"])
    assert result.exit_code == 0, result.output
    line = next(line for line in result.output.splitlines() if line.startswith("demo "))
    assert "GB of memory at its peak" in line and "GB of disk in the cache" in line  # an empty cache: all of it to write
