"""Kernel timings kept across processes (``probe_store``): a near tie between int8 kernels must not send one process
to another kernel, and so another backend, than the next."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from quasar_deploy.cpu import choice, linears
from quasar_deploy.cpu.choice import REPROBE_ENV


@pytest.fixture
def two_exact_kernels(monkeypatch, tmp_path):
    """A cache of the test's own, two exact 32-bit kernels, and timings handed out in turn instead of measured."""
    monkeypatch.setenv("QUASAR_CACHE", str(tmp_path))
    monkeypatch.delenv(REPROBE_ENV, raising=False)
    monkeypatch.setattr(linears, "vnni_available", lambda: True)
    monkeypatch.setattr(linears, "onednn_int8_bit_exact", lambda: True)
    monkeypatch.setattr(linears, "quasar_int8_available", lambda: False)
    monkeypatch.setattr(choice, "onnxruntime_int8_bit_exact", lambda: False)
    timings = [{"fbgemm-vnni": 2.0, "onednn-vnni": 1.0}, {"fbgemm-vnni": 1.0, "onednn-vnni": 2.0}, {"fbgemm-vnni": 3.0, "onednn-vnni": 1.0}]
    monkeypatch.setattr(choice, "_time_int8_kernels", lambda names: timings.pop(0))
    monkeypatch.setattr(choice, "_cpu_seconds_busy", lambda: None)  # the machine's load is not judged (tested below)
    choice.int8_probe.cache_clear()
    yield tmp_path / "kernels"
    choice.int8_probe.cache_clear()  # the next caller probes this CPU itself


def probe_anew() -> choice.Int8Probe:
    """``int8_probe`` as a new process calls it."""
    choice.int8_probe.cache_clear()
    return choice.int8_probe()


def test_an_int8_timing_is_kept_and_reused_until_reprobe_is_asked(two_exact_kernels, monkeypatch):
    assert probe_anew().kernel == "onednn-vnni"
    again = probe_anew()  # the second timing would pick fbgemm-vnni: the kept one holds
    assert again.ms == {"fbgemm-vnni": 2.0, "onednn-vnni": 1.0} and "UTC, kept: QUASAR_REPROBE=1 times again" in again.reason
    monkeypatch.setenv(REPROBE_ENV, "1")
    assert probe_anew().kernel == "fbgemm-vnni"
    monkeypatch.delenv(REPROBE_ENV)
    assert probe_anew().kernel == "fbgemm-vnni"  # the new timing is the one kept


@pytest.mark.parametrize(("others_s", "kept"), [(0.0, True), (100.0, False)])
def test_a_timing_taken_while_other_processes_were_busy_is_not_kept(two_exact_kernels, monkeypatch, others_s, kept):
    readings = [(1000.0, 2), (1000.0 + others_s, 2)] * 2  # CPU seconds busy before and after each timing, two CPUs
    monkeypatch.setattr(choice, "_cpu_seconds_busy", lambda: readings.pop(0))
    monkeypatch.setattr(choice, "MIN_JUDGED_S", 0.0)
    first = probe_anew()
    assert first.kernel == "onednn-vnni" and ("not kept, the next process times again" in first.reason) is not kept
    assert probe_anew().kernel == ("onednn-vnni" if kept else "fbgemm-vnni")  # not kept: the next process timed again


def test_the_machines_busy_seconds_are_read_here_or_not_at_all():
    reading = choice._cpu_seconds_busy()
    assert reading is None or (reading[0] > 0 and reading[1] >= 1)


@pytest.mark.parametrize("damage", ["{", '{"key": {}, "result": {}, "date": "x"}', "[]"])
def test_a_damaged_or_foreign_kept_timing_is_timed_again(two_exact_kernels, damage):
    probe_anew()
    (kept,) = two_exact_kernels.glob("probe-int8-*.json")
    kept.write_text(damage)
    assert probe_anew().kernel == "fbgemm-vnni"  # the second timing, kept in place of the damage
    assert json.loads(kept.read_text())["result"] == {"fbgemm-vnni": 1.0, "onednn-vnni": 2.0}


def test_an_unwritable_cache_still_probes(two_exact_kernels, monkeypatch, tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setenv("QUASAR_CACHE", str(blocked))  # a file where the directory should be
    assert probe_anew().kernel == "onednn-vnni"
    assert probe_anew().kernel == "fbgemm-vnni"  # nothing was kept: timed again


def test_two_processes_on_this_machine_make_the_same_pick(tmp_path):
    """The real probe, in two processes sharing a cache: the second reads the first's timing (on every kind: with one
    exact kernel or none nothing is timed, and both report the same)."""
    code = "import json; from quasar_deploy.cpu.choice import int8_probe as p; print(json.dumps(p().ms))"
    env = {**{k: v for k, v in os.environ.items() if k != REPROBE_ENV}, "QUASAR_CACHE": str(tmp_path)}
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env) for _ in range(2)]
    assert runs[0].stdout == runs[1].stdout
