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


AVX2, AVX512 = ["avx2", "fma"], ["avx2", "avx512_vnni", "avx512f", "fma"]


def _write(tmp_path, name: str, command: str, figures: dict, day: int, isa: list[str], cpu: str = "AMD EPYC") -> None:
    """A bench record in ``tmp_path``, holding only what the page reads of it."""
    machine = {"cpu": cpu, "isa": isa, "threads": 2, "load_1min": 1.0}
    record = dict(record=1, command=command, options={}, version="0.1.0", date=f"2026-12-{day:02d}T00:00:00+00:00", machine=machine)
    (tmp_path / name).write_text(json.dumps(record | {"dtypes": {}, "figures": figures}))


def _e2e(modes: dict[str, tuple[float, float | None]]) -> dict:
    """``bench e2e`` figures: per mode its tokens/s and its ratio to the best float mode."""
    settings = {"artifact": "a", "prompt_count": 2, "prompts": "p.jsonl", "max_new_tokens": 8}
    return {"settings": settings, "modes": {m: {"tokens_per_s": t, "speedup_vs_best-float": r} for m, (t, r) in modes.items()}}


def _serve(rates: dict[int, float], generate: float | None = None, vllm: dict[int, float] | None = None) -> dict:
    """``bench serve`` figures: our server's output tokens/s per number of clients, ``generate`` alone's, vLLM's."""

    def levels(by_clients: dict[int, float]) -> list[dict]:
        return [{"concurrency": n, "tokens_per_s": t, "ttft_ms_p50": 100.0} for n, t in by_clients.items()]

    settings = {"draft": "ngram", "num_draft": 5, "row_budget": True, "model": "m", "max_tokens": 8}
    figures = {"settings": settings, "backend": "cpu W8A8, 2 threads", "levels": levels(rates)}
    if generate is not None:
        figures["generate"] = {"backend": "cpu W8A8", "tokens_per_s": generate}
    return figures | ({"vllm": {"version": "0.32.0", "levels": levels(vllm)}} if vllm else {})


def _verify(ratio: float) -> dict:
    """``bench verify-step`` figures with W8A8 ``ratio`` times faster than the best float step."""
    step = dict(shape="qwen3-0.6b", tokens=6, context=128, threads=2, float_kernel="onednn", int8_kernel="quasar")
    head = dict(int8_lm_head=False, head_dtype="float32")
    return step | head | dict(float_ms={"float32": 100.0}, best_float="float32", w8a8_ms=100.0 / ratio, ratio=ratio, ideal_ratio=2.0)


def _summary_rows(page: str) -> dict[str, dict[str, str]]:
    """The page's summary table: per machine kind, per column title, the cell."""
    header, _, *rows = page.split("## Summary\n", 1)[1].split("\n## ", 1)[0].strip().splitlines()[2:]
    titles = [cell.strip() for cell in header.strip("|").split("|")]
    cells = [[cell.strip() for cell in row.strip("|").split("|")] for row in rows]
    return {row[0]: dict(zip(titles[1:], row[1:])) for row in cells}


def test_the_page_opens_with_one_summary_row_per_machine_kind(tmp_path):
    """One CPU model name with two instruction-set lists is two kinds; each figure comes from the newest record of its
    kind that holds it; a figure no record of a kind holds is a dash; the full list follows the table."""
    from quasar_deploy.bench.record import read_records

    _write(tmp_path, "e2e-avx2-old.json", "bench e2e", _e2e({"ngram-w8a8": (30.0, 1.11), "ngram-float": (27.0, 1.0)}), 1, AVX2)
    e2e = {
        "ngram-float": (20.0, 1.0),
        "ngram-w8a8": (40.0, 2.0),
        "ngram-w8a8-ort": (42.0, 2.1),
        "llamacpp-q8_0": (15.5, 0.77),
        "vllm-w8a8": (45.0, 2.25),
    }
    _write(tmp_path, "e2e-avx2.json", "bench e2e", _e2e(e2e), 3, AVX2)
    _write(tmp_path, "verify-avx2.json", "bench verify-step", _verify(2.31), 2, AVX2)
    _write(tmp_path, "serve-avx512.json", "bench serve", _serve({1: 40.0, 8: 60.0}, generate=50.0, vllm={1: 20.0, 8: 30.0}), 2, AVX512)
    gpu = {"gpu": "NVIDIA H200", "settings": {"tokens": 6, "context": 512}, "verify": [{"shape": "qwen3-8b", "ratio": 0.89}], "e2e": []}
    _write(tmp_path, "gpu.json", "bench gpu", gpu, 4, AVX512, cpu="Intel Xeon")
    page = render(read_records([tmp_path]))
    rows = _summary_rows(page)
    assert list(rows) == ["CPU: AMD EPYC (avx2, avx512_vnni, avx512f, fma)", "CPU: AMD EPYC (avx2, fma)", "GPU: NVIDIA H200"]
    avx2, avx512, h200 = (
        rows["CPU: AMD EPYC (avx2, fma)"],
        rows["CPU: AMD EPYC (avx2, avx512_vnni, avx512f, fma)"],
        rows["GPU: NVIDIA H200"],
    )
    assert avx2["end to end: W8A8 vs best float"] == "2.10x ngram-w8a8-ort (`e2e-avx2.json`)"  # our best mode (not vLLM's), the newest
    assert avx2["verify step: W8A8 vs best float"] == "2.31x qwen3-0.6b, float32 lm_head (`verify-avx2.json`)"
    assert avx2["llama.cpp tokens/s"] == "15.5 llamacpp-q8_0 (`e2e-avx2.json`)"
    assert avx2["vLLM (CPU build) tokens/s"] == "45.0 vllm-w8a8 (`e2e-avx2.json`)"
    assert avx2["serving: most clients vs 1"] == avx2["serving: 1 client vs generate alone"] == "—"
    assert avx512["serving: most clients vs 1"] == "1.50x at 8 clients on cpu (`serve-avx512.json`)"
    assert avx512["serving: 1 client vs generate alone"] == "0.80x on cpu (`serve-avx512.json`)"
    assert avx512["vLLM (CPU build) tokens/s"] == "vLLM 0.32.0 serving: 20.0 at 1, 30.0 at 8 clients (`serve-avx512.json`)"
    assert avx512["end to end: W8A8 vs best float"] == avx512["llama.cpp tokens/s"] == "—"
    assert h200["verify step: W8A8 vs best float"] == "vs bf16: 0.89x qwen3-8b (`gpu.json`)"
    assert h200["end to end: W8A8 vs best float"] == h200["serving: most clients vs 1"] == "—"  # a GPU run without its e2e part
    assert page.index("## Summary") < page.index("## CPU: AMD EPYC\n") < page.index("## GPU: NVIDIA H200") < page.index("## Records")


def test_a_summary_figure_skips_newer_records_without_it_and_breaks_date_ties_by_file_name(tmp_path):
    """A run at 8 clients alone, or of drafters with no float mode, leaves the older value standing; of two records
    of one date the later file name wins, so the table depends on the records alone."""
    from quasar_deploy.bench.record import read_records

    _write(tmp_path, "serve-a.json", "bench serve", _serve({1: 10.0, 8: 20.0}, generate=10.0), 1, AVX2)
    _write(tmp_path, "serve-b.json", "bench serve", _serve({1: 10.0, 8: 30.0}, generate=20.0), 1, AVX2)
    _write(tmp_path, "serve-c-eight-only.json", "bench serve", _serve({8: 99.0}), 2, AVX2)
    _write(tmp_path, "e2e-a.json", "bench e2e", _e2e({"ngram-float": (10.0, 1.0), "ngram-w8a8": (17.0, 1.7)}), 1, AVX2)
    _write(tmp_path, "e2e-b-no-float.json", "bench e2e", _e2e({"ngram-w8a8": (17.0, None), "suffix-w8a8": (20.0, None)}), 2, AVX2)
    (row,) = _summary_rows(render(read_records([tmp_path]))).values()
    assert row["serving: most clients vs 1"] == "3.00x at 8 clients on cpu (`serve-b.json`)"
    assert row["serving: 1 client vs generate alone"] == "0.50x on cpu (`serve-b.json`)"
    assert row["end to end: W8A8 vs best float"] == "1.70x ngram-w8a8 (`e2e-a.json`)"
    assert row["verify step: W8A8 vs best float"] == "—"
