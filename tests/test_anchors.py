"""The anchors (llama.cpp, vLLM's CPU build) without either engine: CI has neither, so these check our side of the protocol.

The runner really runs here, under this environment's python, where neither engine is installed: that path
is the "skipped with a reason" one users see. A recorded reply of a real vLLM run checks the parsing.
"""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from quasar_deploy.bench import anchor_runner, anchors
from quasar_deploy.bench.e2e import Run, _anchor_report
from quasar_deploy.bench.modes import ALL_MODES, MODES
from quasar_deploy.cli import main

# the reply of `anchor_runner.py` under vLLM 0.32.0 (CPU build) for two HumanEval prompts on the demo artifact, 8 tokens
RECORDED = {
    "engine": "vLLM (CPU build)",
    "version": "0.32.0",
    "runs": [
        {"tokens": [199, 482, 370, 375, 63, 436, 63, 71], "wall_s": 0.31},
        {"tokens": [199, 511, 370, 48, 89, 80, 604, 8], "wall_s": 0.29},
    ],
    "details": {"quantization": "compressed-tensors", "dtype": "torch.bfloat16"},
}


@pytest.fixture
def no_anchor_variables(monkeypatch):
    for variable in (*anchors.PYTHON_VARIABLES.values(), anchors.CONVERTER_VARIABLE):
        monkeypatch.delenv(variable, raising=False)


def test_anchor_modes_follow_ours():
    assert ALL_MODES == (*MODES, "llamacpp-q8_0", "llamacpp-q8_0-lookup", "vllm-w8a8", "vllm-w8a8-ngram", "vllm-float-ngram")
    assert {a.engine for a in anchors.ANCHOR_MODES.values()} == set(anchors.PYTHON_VARIABLES)


def test_the_request_carries_our_ids_and_greedy_settings(tmp_path):
    prompts = [[5, 6, 7], list(range(300))]
    lookup = anchors.request("llamacpp-q8_0-lookup", tmp_path / "m.gguf", prompts, 128, {2, 0}, 2, 5, (1, 3))
    assert lookup["engine"] == "llamacpp" and lookup["model"] == str(tmp_path / "m.gguf")
    assert lookup["prompts"] == prompts and lookup["max_new_tokens"] == 128 and lookup["stop_ids"] == [0, 2]
    assert lookup["speculative"] == {"num_draft": 5, "ngram_min": 1, "ngram_max": 3}
    assert lookup["context"] >= 300 + 128 + 5 and lookup["threads"] == 2
    plain = anchors.request("vllm-w8a8", tmp_path, prompts[:1], 16, [0], 1, 5, (1, 3))
    assert plain["speculative"] is None and plain["context"] == 256 and plain["dtype"] == "bfloat16"
    json.dumps(plain)  # what goes down the pipe


def test_an_unconfigured_or_missing_python_is_a_reason(no_anchor_variables, tmp_path):
    with pytest.raises(anchors.AnchorSkipped, match="set QUASAR_VLLM_PYTHON or --anchor-python vllm=PYTHON"):
        anchors.python_for("vllm", anchors.pythons({}))
    with pytest.raises(anchors.AnchorSkipped, match="is not an executable python"):
        anchors.python_for("llamacpp", {"llamacpp": str(tmp_path / "bin" / "python")})
    with pytest.raises(Exception, match="unknown engine 'ollama'"):
        anchors.pythons({"ollama": "/usr/bin/python3"})


def test_the_environment_variable_names_the_python(monkeypatch):
    monkeypatch.setenv("QUASAR_LLAMACPP_PYTHON", sys.executable)
    assert anchors.python_for("llamacpp", anchors.pythons({})) == Path(sys.executable)
    assert anchors.pythons({"llamacpp": "/other/python"})["llamacpp"] == "/other/python"  # the option wins


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is not None, reason="llama_cpp is installed in this environment")
def test_the_runner_says_in_one_line_that_its_engine_is_missing(tmp_path):
    """The real runner in a real subprocess, under a python that lacks the engine (ours)."""
    request = anchors.request("llamacpp-q8_0", tmp_path / "m.gguf", [[1, 2, 3]], 4, [0], 1, 5, (1, 3))
    with pytest.raises(anchors.AnchorSkipped, match=f"llama_cpp is not importable by {sys.executable}"):
        anchors.run(Path(sys.executable), request)


def test_the_runner_refuses_an_unknown_engine():
    assert "unknown anchor engine 'tgi'" in anchor_runner.respond({"engine": "tgi"})["error"]


def test_a_recorded_reply_parses_and_bad_ones_become_reasons():
    result = anchors.parse_response(json.dumps(RECORDED), 2)
    assert result.engine == "vLLM (CPU build)" and result.version == "0.32.0"
    assert [r.tokens[:2] for r in result.runs] == [[199, 482], [199, 511]] and result.runs[1].wall_s == 0.29
    with pytest.raises(anchors.AnchorSkipped, match="returned 2 runs for 3 prompts"):
        anchors.parse_response(json.dumps(RECORDED), 3)
    with pytest.raises(anchors.AnchorSkipped, match="^vllm failed: ValueError: no CPU kernel$"):
        anchors.parse_response('{"error": "vllm failed: ValueError: no CPU kernel"}', 1)
    with pytest.raises(anchors.AnchorSkipped, match="not JSON"):
        anchors.parse_response("INFO loading\n", 1)
    with pytest.raises(anchors.AnchorSkipped, match="lacks a field"):
        anchors.parse_response('{"engine": "x", "version": "1"}', 1)


def _runs(tokens_per_s, tokens):
    return [Run(t, tps, len(t) / tps) for tps, t in zip(tokens_per_s, tokens)]


def test_the_report_sets_our_best_w8a8_mode_against_each_anchor():
    ours = [[1, 2, 3, 4], [5, 6, 7, 8]]
    runs = {
        "ar-float": _runs([40, 40], ours),
        "ar-w8a8": _runs([60, 80], [[1, 2, 3, 4], [5, 6, 9, 9]]),
        "ngram-w8a8": _runs([100, 50], [[1, 2, 3, 4], [5, 6, 9, 9]]),
        "vllm-w8a8": _runs([25, 80], [[1, 2, 0, 4], [5, 6, 9, 9]]),
    }
    result = anchors.parse_response(json.dumps(RECORDED), 2)
    report = _anchor_report({"vllm-w8a8": result}, runs, ["ar-w8a8", "ngram-w8a8"])["vllm-w8a8"]
    # best of ours per prompt: 100, 80; over the anchor's 25, 80: 4.0 and 1.0, median 2.5
    assert report["best_w8a8_vs_it"] == 2.5 and report["best_w8a8_modes"] == ["ar-w8a8", "ngram-w8a8"]
    assert report["tokens_matching_float"] == {"reference": "ar-float", "share": 5 / 8, "mean_common_prefix": 2.0}
    assert report["tokens_matching_w8a8"] == {"reference": "ar-w8a8", "share": 7 / 8, "mean_common_prefix": 3.0}
    assert report["version"] == "0.32.0" and "per token" in report["numerics"]


def test_conversion_without_a_converter_is_a_reason(no_anchor_variables, tiny_qwen3, tmp_path):
    python = tmp_path / "venv" / "bin" / "python"
    with pytest.raises(anchors.AnchorSkipped, match="no GGUF converter at .*convert/convert_hf_to_gguf.py"):
        anchors.gguf_for(python, tiny_qwen3, tmp_path / "cache")


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is not None, reason="llama_cpp is installed in this environment")
def test_a_failed_conversion_leaves_nothing(monkeypatch, tiny_qwen3, tmp_path):
    """The conversion runs in the runner under the anchor's python: ours lacks llama_cpp, so it fails, writing nothing."""
    converter = tmp_path / "convert" / "convert_hf_to_gguf.py"
    converter.parent.mkdir()
    converter.write_text("")
    monkeypatch.setenv(anchors.CONVERTER_VARIABLE, str(converter))
    with pytest.raises(anchors.AnchorSkipped, match=f"GGUF conversion failed: llama_cpp is not importable by {sys.executable}"):
        anchors.gguf_for(Path(sys.executable), tiny_qwen3, tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []


def test_only_a_gpt2_byte_level_tokenizer_is_declared_gpt2(tmp_path):
    """The converter's fallback for tokenizers it does not know by hash (anchor_runner._convert)."""
    for pre, expected in [({"type": "ByteLevel", "use_regex": True}, True), ({"type": "Metaspace"}, False), (None, False)]:
        (tmp_path / "tokenizer.json").write_text(json.dumps({"pre_tokenizer": pre}))
        assert anchor_runner._byte_level_gpt2(str(tmp_path)) is expected
    assert anchor_runner._byte_level_gpt2(str(tmp_path / "missing")) is False


def test_bench_reports_why_each_anchor_was_skipped(no_anchor_variables, tiny_qwen3, tiny_artifact, tmp_path):
    args = ["bench", "e2e", str(tiny_artifact.path), "--reference", str(tiny_qwen3), "--limit", "1", "--max-new-tokens", "4"]
    args += ["--modes", "ar-w8a8,llamacpp-q8_0,vllm-w8a8", "--anchor-python", f"vllm={sys.executable}"]
    result = CliRunner().invoke(main, [*args, "-o", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert list(report["modes"]) == ["ar-w8a8"] and "anchors" not in report
    assert report["skipped"]["llamacpp-q8_0"].startswith("llamacpp-q8_0: llamacpp not configured: set QUASAR_LLAMACPP_PYTHON")
    if importlib.util.find_spec("vllm") is None:
        assert report["skipped"]["vllm-w8a8"] == f"vllm-w8a8: vllm is not importable by {sys.executable}: No module named 'vllm'"
    assert "Skipped:" in result.output and "- llamacpp-q8_0: llamacpp not configured" in result.output


@pytest.mark.parametrize(("value", "message"), [("vllm", "takes ENGINE=PYTHON, not 'vllm'"), ("tgi=/x", "unknown engine 'tgi'")])
def test_a_bad_anchor_python_is_refused_in_one_line(value, message, tmp_path):
    result = CliRunner().invoke(main, ["bench", "e2e", "--synthetic", "qwen3-0.6b", "--anchor-python", value, "-o", str(tmp_path)])
    assert result.exit_code == 1 and message in result.output and "Traceback" not in result.output
