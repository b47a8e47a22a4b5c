"""``quasar-deploy bench serve``: the report's structure and sanity on a tiny artifact (no timing assertions)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from quasar_deploy.artifact import open_model_files
from quasar_deploy.bench.serving import WideVocabulary, percentile
from quasar_deploy.cli import main
from quasar_deploy.demo import demo_model_path
from quasar_deploy.tokenizer import load_tokenizer

from .helpers import assert_one_line_error

pytest.importorskip("fastapi")


def test_bench_serve_reports_every_concurrency(tiny_artifact, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [f"def f{i}(x):\n    return x + {i}\n\n\ndef f{i}("]}) + "\n" for i in range(2)))
    out = tmp_path / "report"
    args = ["bench", "serve", str(tiny_artifact.path), "--prompts", str(prompts), "--concurrency", "1,2", "--max-tokens", "8"]
    result = CliRunner().invoke(main, [*args, "-o", str(out), "--compare", "suffix-adaptive"])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    assert report["settings"]["prompt_count"] == 2 and report["settings"]["concurrency"] == [1, 2]
    assert [level["concurrency"] for level in report["levels"]] == [1, 2]
    for level in report["levels"]:
        assert level["requests"] == 2 and 2 <= level["output_tokens"] <= 16 and level["tokens_per_s"] > 0
        assert 0 < level["ttft_ms_p50"] <= level["ttft_ms_p99"]
        assert level["itl_ms_p50"] is None or level["itl_ms_p50"] <= level["itl_ms_p99"]
        assert level["acceptance_length"] is None or 1 <= level["acceptance_length"] <= 6
    assert report["levels"][0]["throughput_vs_concurrency_1"] == 1.0
    # generate alone on the same prompts (auto's backend, no server): what one client should get from the server
    alone = report["generate"]
    assert alone["tokens_per_s"] > 0 and 2 <= alone["output_tokens"] <= 16 and alone["backend"]
    assert report["levels"][0]["vs_generate"] == pytest.approx(report["levels"][0]["tokens_per_s"] / alone["tokens_per_s"])
    assert report["levels"][1]["vs_generate"] is None and "`generate` alone" in result.output
    # what auto serves (the cpu backend where the int8 probe picks our kernel, else ONNX Runtime's layer graphs), named
    # by the server process's startup line. The server probes in its own process: where two kernels time alike (seen on
    # the Intel Xeon kind) its pick may differ from this process's, so the line is checked against the rule itself.
    backend = report["backend"]
    assert backend.startswith(("onnxruntime cpu (W8A8 integer layer graphs", "cpu W8A8, "))
    assert backend.startswith("cpu W8A8, ") == ("int8 kernel quasar" in backend)
    assert len(report["environment"]["load_average_at_start"]) == 3
    assert "| 2 | 2 |" in (out / "report.md").read_text() and "| 2 | 2 |" in result.output
    # the variant through the same server: its own levels, each against the --draft one
    compared = report["compared"]["suffix-adaptive"]
    assert [level["concurrency"] for level in compared] == [1, 2]
    for ours, level in zip(report["levels"], compared):
        assert level["requests"] == 2 and level["vs_draft"] == pytest.approx(level["tokens_per_s"] / ours["tokens_per_s"])
    assert "Drafting suffix-adaptive" in (out / "report.md").read_text()
    again = CliRunner().invoke(main, [*args, "-o", str(out)])  # the report directory is never overwritten
    assert_one_line_error(again, "already exists")


@pytest.mark.parametrize("variant", ["medusa", "none-adaptive", "ngram-fast"])
def test_bench_serve_refuses_an_unknown_variant_before_any_work(tmp_path, variant):
    result = CliRunner().invoke(main, ["bench", "serve", "--synthetic", "qwen3-0.6b", "--compare", variant, "-o", str(tmp_path / "r")])
    assert_one_line_error(
        result, f"--compare takes drafters (ngram, suffix, layerskip, none), each optionally with -adaptive; got '{variant}'"
    )


def test_bench_serve_refuses_an_artifact_and_a_shape(tmp_path):
    result = CliRunner().invoke(main, ["bench", "serve", str(tmp_path), "--synthetic", "qwen3-0.6b", "-o", str(tmp_path / "r")])
    assert_one_line_error(result, "not both")
    result = CliRunner().invoke(main, ["bench", "serve", "--synthetic", "qwen3-0.6b", "--backend", "cpu", "-o", str(tmp_path / "r")])
    assert_one_line_error(result, "--backend applies to an ARTIFACT")


def test_wide_vocabulary_shows_ids_past_the_tokenizer():
    tokenizer = load_tokenizer(open_model_files(demo_model_path()))
    wide = WideVocabulary(tokenizer)
    known = tokenizer.encode("hello world")
    assert wide.decode(known) == tokenizer.decode(known)
    assert wide.decode([*known, 100000, *known]) == tokenizer.decode(known) + " <100000>" + tokenizer.decode(known)
    assert wide.eos_token_id == tokenizer.eos_token_id


def test_percentile_is_nearest_rank():
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0 and percentile([3.0, 1.0, 2.0], 99) == 3.0 and percentile([5.0], 1) == 5.0


FAKE_VLLM = """#!{python}
# Stands in for a vLLM venv's python: `-c` prints a version, `-m vllm.entrypoints.openai.api_server` serves the model
# with quasar-deploy's own server on the port and name given (the harness under test is bench serve's, not vLLM).
import sys

args = sys.argv[1:]
if args[0] == "-c":
    print("0.0-stand-in")
    sys.exit(0)
if {fail}:
    print("error: this stand-in refuses to start")
    sys.exit(3)
if "--no-enable-prefix-caching" not in args:  # the bench's prompts repeat across levels: vLLM must not reuse their KV
    print("error: prefix caching left on")
    sys.exit(4)
options = dict(zip(args[2::2], args[3::2]))
from quasar_deploy.cli import main

main(["serve", options["--model"], "--port", options["--port"], "--model-name", options["--served-model-name"], "--backend", "cpu"])
"""


def _fake_vllm(tmp_path, fail: bool = False):
    import sys

    python = tmp_path / ("broken-python" if fail else "python")
    python.write_text(FAKE_VLLM.format(python=sys.executable, fail=fail))
    python.chmod(0o755)
    return python


def test_bench_serve_runs_vllm_after_us_and_compares_level_by_level(tiny_artifact, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [f"def f{i}(x):\n    return x + {i}\n"]}) + "\n" for i in range(2)))
    out = tmp_path / "report"
    args = ["bench", "serve", str(tiny_artifact.path), "--prompts", str(prompts), "--concurrency", "1,2", "--max-tokens", "8"]
    result = CliRunner().invoke(main, [*args, "-o", str(out), "--vllm-python", str(_fake_vllm(tmp_path))])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    assert report["vllm"]["version"] == "0.0-stand-in"
    assert [level["concurrency"] for level in report["vllm"]["levels"]] == [1, 2]
    for ours, theirs in zip(report["levels"], report["vllm"]["levels"]):
        assert ours["vs_vllm"] == pytest.approx(ours["tokens_per_s"] / theirs["tokens_per_s"])
        assert theirs["requests"] == 2 and 2 <= theirs["output_tokens"] <= 16  # the same prompts and limits were served
    assert "vLLM 0.0-stand-in (CPU build)" in (out / "report.md").read_text()
    broken = CliRunner().invoke(main, [*args, "-o", str(tmp_path / "r2"), "--vllm-python", str(_fake_vllm(tmp_path, fail=True))])
    assert_one_line_error(broken, "refuses to start")
    synthetic = CliRunner().invoke(main, ["bench", "serve", "--synthetic", "qwen3-0.6b", "-o", str(tmp_path / "r3"), "--vllm-python", "py"])
    assert_one_line_error(synthetic, "vLLM serves an artifact directory")


def test_interleaved_rotates_the_order_and_keeps_each_levels_median_run():
    from quasar_deploy.bench.serving import interleaved

    order, speed = [], {"a": iter([10, 30, 20]), "b": iter([5, 7, 6])}

    def run(name):
        order.append(name)
        tokens_per_s = next(speed[name])
        return [{"concurrency": 1, "tokens_per_s": tokens_per_s}, {"concurrency": 8, "tokens_per_s": 3 * tokens_per_s}]

    picked = interleaved(["a", "b"], 3, run)
    assert order == ["a", "b", "b", "a", "a", "b"]
    assert [level["tokens_per_s"] for level in picked["a"]] == [20, 60]
    assert picked["a"][0]["tokens_per_s_rounds"] == [10, 30, 20]
    assert picked["b"][1]["throughput_vs_concurrency_1"] == 3.0
    assert "tokens_per_s_rounds" not in interleaved(["a"], 1, lambda name: [{"concurrency": 1, "tokens_per_s": 1.0}])["a"][0]
