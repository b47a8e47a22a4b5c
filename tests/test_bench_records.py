"""``--json`` on the bench subcommands prints one record type, and ``bench report`` renders the benchmarks page from them."""

import datetime
import json
import os
from unittest import mock

import pytest
import torch
from click.testing import CliRunner

from quasar_deploy._version import __version__
from quasar_deploy.bench.record import FIELDS, VIEW_ENV, current, render
from quasar_deploy.cli import main
from quasar_deploy.cpu.linears import half_weights
from quasar_deploy.cpu.machine import cpu_model

from .helpers import assert_one_line_error


@pytest.fixture(scope="module")
def roofline_record(tiny_artifact) -> dict:
    """A record of this CPU itself (CI's second pass runs the suite under tools/avx2_view.sh, which marks records)."""
    with mock.patch.dict(os.environ):
        os.environ.pop(VIEW_ENV, None)
        result = CliRunner().invoke(main, ["bench", "roofline", str(tiny_artifact.path), "--max-new-tokens", "8", "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_a_record_says_what_ran_where_when_and_what_it_measured(roofline_record, tiny_artifact):
    r = roofline_record
    assert list(r) == list(FIELDS)
    assert r["command"] == "bench roofline" and r["options"]["path"] == str(tiny_artifact.path) and r["options"]["max_new_tokens"] == 8
    assert r["version"] == __version__ and r["machine"]["cpu"] == cpu_model() and r["machine"]["threads"] >= 1
    assert {"isa", "int8_kernel", "float_kernel", "load_1min"} <= set(r["machine"])
    assert r["dtypes"] == {"w8a8": "int8 weights, int8 per-token activations, float32 lm_head"}  # an artifact runs W8A8
    age = datetime.datetime.now(datetime.timezone.utc) - datetime.datetime.fromisoformat(r["date"])
    assert datetime.timedelta(0) <= age < datetime.timedelta(minutes=10)
    assert r["figures"]["new_tokens"] == 8 and r["figures"]["model"] == str(tiny_artifact.path)


def test_report_renders_the_newest_value_per_quantity_and_machine(roofline_record, tmp_path):
    older = json.loads(json.dumps(roofline_record)) | {"date": "2000-01-01T00:00:00+00:00"}
    older["figures"]["tokens_per_s"] = 987654.3  # no other cell of the page can hold it (a load average of 1.5 did)
    other = json.loads(json.dumps(roofline_record))
    other["machine"]["cpu"] = "Another CPU"
    for name, record in {"a.json": roofline_record, "b-older.json": older, "c-other.json": other}.items():
        (tmp_path / name).write_text(json.dumps(record))
    page = tmp_path / "benchmarks.md"
    result = CliRunner().invoke(main, ["bench", "report", str(tmp_path), "-o", str(page)])
    assert result.exit_code == 0, result.output
    text = page.read_text()
    name = roofline_record["figures"]["model"].rsplit("/", 1)[-1]
    section = text.split(f"## CPU: {cpu_model()}\n", 1)[1].split("\n## ", 1)[0]  # sections sort by CPU name: "Another CPU" may come first
    row = next(line for line in section.splitlines() if line.startswith(f"| one generation of {name}, ngram drafting: tokens/s |"))
    assert f"| {roofline_record['figures']['tokens_per_s']:.1f} |" in row and "`a.json`" in row  # the newer record wins
    assert "987654.3" not in text and f"## CPU: {cpu_model()}" in text and "## CPU: Another CPU" in text
    assert "`b-older.json` | `bench roofline`" in text  # every record is listed with its command
    assert current([older, roofline_record | {"file": "a.json"}])[f"CPU: {cpu_model()}"]


def test_report_refuses_what_is_not_a_record(tmp_path):
    (tmp_path / "x.json").write_text('{"figures": {}}')
    assert_one_line_error(CliRunner().invoke(main, ["bench", "report", str(tmp_path)]), "not a bench record (no record, command")
    (tmp_path / "x.json").write_text("{")
    assert_one_line_error(CliRunner().invoke(main, ["bench", "report", str(tmp_path)]), "x.json: not a readable JSON record")
    (tmp_path / "x.json").unlink()
    assert_one_line_error(CliRunner().invoke(main, ["bench", "report", str(tmp_path)]), "no records in")


def test_a_record_made_under_a_view_of_the_cpu_is_kept_apart(roofline_record):
    """tools/avx2_view.sh marks what is measured under it: its figures are the view's, not this CPU's own."""
    viewed = json.loads(json.dumps(roofline_record))
    viewed["machine"]["view"] = "avx2"
    table = current([roofline_record | {"file": "own.json"}, viewed | {"file": "view.json"}])
    assert table[f"CPU: {cpu_model()}"] and table[f"CPU: {cpu_model()}, avx2 view"]
    assert f"## CPU: {cpu_model()}, avx2 view" in render([viewed | {"file": "view.json"}])


def test_line_reports_are_records_too(monkeypatch):
    """``bench onnx`` prints lines as they come; with ``--json`` they are the figures of one record."""
    pytest.importorskip("onnxruntime")
    monkeypatch.delenv(VIEW_ENV, raising=False)
    args = ["bench", "onnx", "layers", "--size", "64", "--depth", "1", "--rows", "1", "--repeats", "1", "--json"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    record = json.loads(result.output)
    assert record["command"] == "bench onnx layers" and record["options"]["rows"] == [1]
    lines = record["figures"]["lines"]
    assert lines[0].startswith("64x64, 1 distinct layers") and lines[1].startswith("M=1 ") and len(lines) == 2
    assert f"## CPU: {cpu_model()}" in render([record | {"file": "layers.json"}])


def test_the_benchmarks_page_is_the_committed_records_rendered():
    """docs/benchmarks.md is generated: regenerate it (`quasar-deploy bench report bench/results -o docs/benchmarks.md`)
    after adding a record, never edit it by hand."""
    from pathlib import Path

    from quasar_deploy.bench.record import read_records

    root = Path(__file__).resolve().parent.parent
    assert (root / "docs" / "benchmarks.md").read_text() == render(read_records([root / "bench" / "results"]))


def test_verify_step_and_gpu_records_render(monkeypatch):
    from quasar_deploy.bench import synthetic

    from .test_cuda import RECORDED

    monkeypatch.setitem(synthetic.SHAPES, "test-tiny", (64, 128, 2, 4, 2, 16, 512, True))
    monkeypatch.delenv(VIEW_ENV, raising=False)
    args = ["bench", "verify-step", "--synthetic", "test-tiny", "--tokens", "3", "--context", "8", "--repeats", "2", "--json"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    record = json.loads(result.output) | {"file": "verify.json"}
    head = " over 16-bit weights (quasar-half)" if half_weights(torch.bfloat16, torch.float32, "onednn") else ""  # drawn bf16
    assert record["dtypes"] == {"float": "float32", "w8a8": f"int8 weights, int8 per-token activations, float32 lm_head{head}"}
    gpu = dict(record, command="bench gpu", figures=RECORDED, file="gpu.json")  # a recorded bench gpu result
    table = current([record, gpu])
    f = record["figures"]
    rows = table[f"CPU: {cpu_model()}"]
    speedup = next(v for q, (v, _) in rows.items() if q.startswith("verify step, test-tiny") and "speed-up" in q)
    assert speedup == f"{f['ratio']:.2f}x"
    assert table["GPU: NVIDIA H200"] == {
        "GPU verify step, qwen3-8b (synthetic weights), 6 tokens on a 512-token cache: W8A8 vs bf16": ("1.75x", gpu),
        "GPU n-gram end to end, demo (trained): W8A8 vs bf16": ("1.30x", gpu),
    }


def test_a_fidelity_record_renders_its_summing_up_line():
    lines = ["27 positions: max |logit diff| 1e-05 (max |logit| 15.6), top-1 agreement 1.0000, greedy identical for 16/16 tokens"]
    lines.append("ONNX Runtime vs torch, all 1 prompts of x.jsonl: greedy text identical on 1, mean common prefix 16.0/16 tokens")
    record = {"command": "bench onnx fidelity", "machine": {"cpu": "CPU"}, "figures": {"lines": lines}, "date": "2026-12-01T00:00:00+00:00"}
    rows = current([record | {"file": "f.json"}])["CPU: CPU"]
    assert rows["ONNX Runtime vs torch, all 1 prompts of x.jsonl"][0] == "greedy text identical on 1, mean common prefix 16.0/16 tokens"


def test_onnx_step_lines_render_one_quantity_per_contender_and_paths_by_name():
    from quasar_deploy.bench.record import _last_parts, _lines

    lines = ["qwen3-0.6b (synthetic weights), 6-token verify, 2 threads; AMD EPYC, float dtype bfloat16"]
    lines += [
        "  ORT fp32                      110.0 ms (median)",
        "  ORT W8A8 + bf16 head (auto)     53.6 ms (median)   1.48x the best float",
    ]
    lines += ["  ideal W8A8 speed-up by weight bytes read, against bfloat16 float: 1.58x"]
    what = "qwen3-0.6b (synthetic weights), 6-token verify, 2 threads"
    assert _lines({"lines": lines}) == [
        (f"{what}: ORT fp32", "110.0 ms (median)"),
        (f"{what}: ORT W8A8 + bf16 head (auto)", "53.6 ms (median) 1.48x the best float"),
        (f"{what}: ideal W8A8 speed-up by weight bytes read, against bfloat16 float", "1.58x"),
    ]
    assert _last_parts("/home/me/models/q06") == "q06" and _last_parts(["llamacpp=/opt/v/bin/python"]) == ["llamacpp=python"]
    assert _last_parts("../data/x.jsonl") == "../data/x.jsonl" and _last_parts(8) == 8


def test_an_e2e_record_comparing_drafters_renders_their_acceptance_lengths():
    def mode(acceptance):
        return {"tokens_per_s": 10.0, "acceptance_length": acceptance}

    settings = {"artifact": "a", "prompt_count": 2, "prompts": "p.jsonl", "max_new_tokens": 8}
    figures = {"settings": settings, "modes": {"ar-w8a8": mode(1.0), "ngram-w8a8": mode(2.5), "suffix-w8a8": mode(2.75)}}
    record = {"command": "bench e2e", "machine": {"cpu": "CPU"}, "figures": figures, "date": "2026-12-03T00:00:00+00:00"}
    rows = current([record | {"file": "e.json"}])["CPU: CPU"]
    accepted = {q.split(": ")[-1]: v for q, (v, _) in rows.items() if q.endswith("acceptance length")}
    assert accepted == {"ngram-w8a8 acceptance length": "2.50", "suffix-w8a8 acceptance length": "2.75"}
    plain = current([record | {"file": "e.json", "figures": figures | {"modes": {"ngram-w8a8": mode(2.5)}}}])["CPU: CPU"]
    assert not any(q.endswith("acceptance length") for q in plain)  # n-gram alone: its speeds, as before
