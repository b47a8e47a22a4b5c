"""Benchmark smoke tests (not timing tests): every mode runs, the report is complete, lossless modes are lossless.

``bench verify-step``, ``bench kernels`` and ``bench onnx`` take minutes at real shapes, so only their command lines are checked here.
"""

import json

import pytest
import torch
from click.testing import CliRunner

from quasar_deploy.artifact import open_model_files
from quasar_deploy.bench.anchors import ANCHOR_MODES, PYTHON_VARIABLES
from quasar_deploy.bench.contenders import _hf_twin
from quasar_deploy.bench.modes import MODES
from quasar_deploy.cli import main


@pytest.fixture
def pair(tiny_qwen3, tiny_artifact):
    return tiny_qwen3, tiny_artifact.path


@pytest.mark.slow
def test_every_mode_reports_and_lossless_holds(pair, tmp_path, monkeypatch):
    for variable in PYTHON_VARIABLES.values():  # the anchors are skipped, each with its reason (tests/test_anchors.py)
        monkeypatch.delenv(variable, raising=False)
    model, artifact = pair
    out = tmp_path / "report"
    args = ["bench", "e2e", str(artifact), "--reference", str(model), "--limit", "2", "--max-new-tokens", "8"]
    result = CliRunner().invoke(main, [*args, "-o", str(out), "--sweep-k", "2,4"])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    assert set(report) >= {"settings", "environment", "modes", "lossless", "sweep_k"}
    assert list(report["modes"]) == list(MODES) and list(report["skipped"]) == list(ANCHOR_MODES)
    for mode, figures in report["modes"].items():
        assert figures["tokens_per_s"] > 0 and figures["new_tokens"] > 0, mode
        assert figures["speedup_vs_ngram-float"] > 0 and figures["speedup_vs_ar-float"] > 0, mode
    # a speedup is per-prompt tokens/s over the baseline's: each baseline against itself is exactly 1
    assert report["modes"]["ar-float"]["speedup_vs_ar-float"] == 1.0
    assert report["modes"]["ngram-float"]["speedup_vs_ngram-float"] == 1.0
    assert report["modes"]["ar-float"]["agreement_with_ar_float"] == 1.0
    assert report["modes"]["ngram-w8a8"]["acceptance_length"] >= 1.0
    assert report["lossless"] and all(report["lossless"].values())
    assert report["environment"]["torch"] == torch.__version__
    for name in ("report.md", "tokens_per_s.png", "acceptance_length.png", "speedup_vs_k.png"):
        assert (out / name).stat().st_size > 0, name


def test_sampled_benchmark_runs(pair, tmp_path):
    model, artifact = pair
    args = ["bench", "e2e", str(artifact), "--reference", str(model), "--limit", "1", "--max-new-tokens", "6", "--temperature", "1"]
    args += ["--modes", "ngram-float,ngram-w8a8"]
    result = CliRunner().invoke(main, [*args, "--output", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)["figures"]
    assert "lossless" not in report
    assert list(report["modes"]) == ["ngram-float", "ngram-w8a8"] and report["settings"]["temperature"] == 1
    assert all(figures["new_tokens"] > 0 for figures in report["modes"].values())


def test_reference_defaults_to_the_recorded_source(pair, tmp_path):
    model, artifact = pair
    args = ["bench", "e2e", str(artifact), "--limit", "1", "--max-new-tokens", "4", "--modes", "ar-float,ar-w8a8"]
    result = CliRunner().invoke(main, [*args, "-o", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["figures"]["settings"]["model"] == str(model)


def test_bench_needs_an_artifact_or_a_shape(pair, tmp_path):
    result = CliRunner().invoke(main, ["bench", "e2e", "-o", str(tmp_path)])
    assert result.exit_code == 1 and "give ARTIFACT" in result.output
    result = CliRunner().invoke(main, ["bench", "e2e", str(pair[1]), "--synthetic", "qwen3-0.6b", "-o", str(tmp_path)])
    assert result.exit_code == 1 and "not both" in result.output


def test_modes_keep_their_names_and_order():
    assert MODES == (
        "ar-float",
        "ar-w8a8",
        "ngram-float",
        "ngram-w8a8",
        "suffix-float",
        "suffix-w8a8",
        "layerskip-float",
        "layerskip-w8a8",
        "ngram-w8a8-adaptive",
        "suffix-w8a8-adaptive",
        "hf-prompt-lookup",
        "pruned-verify",
        "exact-ngram",
        "ar-float-ort",
        "ngram-float-ort",
        "ngram-w8a8-ort",
        "exact-ngram-ort",
        "exact-ngram-ort-draft",
    )


@pytest.mark.parametrize(
    "command",
    [
        ["e2e"],
        ["serve"],
        ["batched-step"],
        ["gpu"],
        ["first-call"],
        ["verify-step"],
        ["kernels"],
        ["roofline"],
        ["onnx"],
        ["onnx", "layers"],
        ["onnx", "step"],
        ["onnx", "fidelity"],
    ],
)
def test_every_bench_subcommand_has_help(command):
    """Each help says what the subcommand measures (its docstring) and, for one that measures, offers its --json record."""
    result = CliRunner().invoke(main, ["bench", *command, "--help"])
    assert result.exit_code == 0, result.output
    assert result.output.startswith(f"Usage: main bench {' '.join(command)} [OPTIONS]")
    group = main.get_command(None, "bench")
    for name in command:
        group = cmd = group.get_command(None, name)
    assert " ".join(cmd.help.split()) in " ".join(result.output.split())
    assert ("--json" in result.output) == (command != ["onnx"])  # every measuring subcommand writes a record


@pytest.mark.parametrize("command", [["e2e", "--synthetic", "qwen3-0.6b", "--sweep-k"], ["onnx", "layers", "--rows"]])
def test_integer_lists_fail_as_usage_errors(command):
    result = CliRunner().invoke(main, ["bench", *command, "1,two"])
    assert result.exit_code == 2
    assert f"Invalid value for '{command[-1]}': expected comma-separated integers, not '1,two'" in result.output


def test_hf_twin_shares_our_weights(tiny_qwen3):
    decoder = open_model_files(tiny_qwen3).decoder()
    twin = _hf_twin(decoder.spec, decoder.state_dict())
    ids = torch.arange(5, 30)
    with torch.no_grad():
        expected = twin(ids[None]).logits[0]
    torch.testing.assert_close(decoder(ids, decoder.new_cache()), expected, atol=2e-5, rtol=1e-4)


def test_roofline_sets_a_generation_against_the_bandwidth_bound(tiny_artifact):
    """The bound is bytes read per step over the measured bandwidth; a real step is slower than it."""
    from quasar_deploy.api import load
    from quasar_deploy.bench.micro import weight_bytes

    result = CliRunner().invoke(main, ["bench", "roofline", str(tiny_artifact.path), "--max-new-tokens", "8", "--json"])
    assert result.exit_code == 0, result.output
    r = json.loads(result.output)["figures"]
    assert r["new_tokens"] == 8 and r["acceptance_length"] >= 1.0 and r["verify_step_ms"] > 0 and r["bandwidth_gb_s"] > 0
    assert r["bytes_per_step"] > weight_bytes(load(tiny_artifact.path, backend="cpu").lm.decoder)  # weights plus the KV cache
    assert r["bound_step_ms"] == pytest.approx(r["bytes_per_step"] / (r["bandwidth_gb_s"] * 1e9) * 1e3)
    assert 0 < r["fraction_of_bound"] == pytest.approx(r["bound_step_ms"] / r["verify_step_ms"])


def test_first_call_times_each_generation_after_one_load(tiny_artifact, tmp_path):
    """``bench first-call``: one load, then CALLS generations of the same prompts, each call's decode speed and the first
    against the median of the others (the figures themselves are machine-dependent: not asserted)."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"turns": ["def f(x):"]}\n{"turns": ["class A:"]}\n{"turns": ["unused"]}\n')
    args = ["bench", "first-call", str(tiny_artifact.path), "--backend", "cpu", "--max-new-tokens", "6", "--calls", "4"]
    result = CliRunner().invoke(main, [*args, "--prompts", str(prompts), "--limit", "2", "--json"])
    assert result.exit_code == 0, result.output
    r = json.loads(result.output)["figures"]
    assert r["backend"] == "cpu" and r["prompts"] == 2 and r["load_s"] > 0 and len(r["decode_tokens_per_s"]) == 4
    assert all(rate > 0 for rate in r["decode_tokens_per_s"]) and all(0 < n <= 12 for n in r["new_tokens"])
    rest = sorted(r["decode_tokens_per_s"][1:])[1]
    assert r["first_vs_rest"] == pytest.approx(r["decode_tokens_per_s"][0] / rest)
    text = CliRunner().invoke(main, [*args[:-1], "2"]).output
    assert "call 2:" in text and "call 3:" not in text and "first call at" in text and "load (warm-up included)" in text
    missing = CliRunner().invoke(main, [*args, "--prompts", str(tmp_path / "none.jsonl")])
    assert missing.exit_code == 1 and missing.output.strip() == f"error: {tmp_path / 'none.jsonl'}: no such prompt file"


def test_batched_step_times_each_serving_backend_at_each_count(tiny_artifact):
    """``bench batched-step``: each backend's batched serving step at every sequence count, in a record the page renders."""
    from quasar_deploy.bench.record import HEADLINES

    pytest.importorskip("onnxruntime")
    args = ["bench", "batched-step", str(tiny_artifact.path), "--sequences", "1,3", "--repeats", "1", "--context", "20"]
    result = CliRunner().invoke(main, [*args, "--json"])
    assert result.exit_code == 0, result.output
    record = json.loads(result.output)
    r = record["figures"]
    assert set(r["ms"]) == {"cpu", "onnxruntime"} and all(set(by_n) == {"1", "3"} for by_n in r["ms"].values())
    assert all(ms > 0 for by_n in r["ms"].values() for ms in by_n.values())
    assert "layer graphs" in r["descriptions"]["onnxruntime"]
    assert r["prefill_tokens"] == 256 and set(r["prefill_ms"]) == {"cpu", "onnxruntime"} and min(r["prefill_ms"].values()) > 0
    assert len(HEADLINES["bench batched-step"](r)) == 6
    text = CliRunner().invoke(main, args).output
    assert "onnxruntime vs cpu:" in text and "3 over 1:" in text and "prefill of a 256-token prompt piece" in text
    without = json.loads(CliRunner().invoke(main, [*args, "--prefill", "0", "--json"]).output)["figures"]
    assert without["prefill_ms"] == {} and len(HEADLINES["bench batched-step"](without)) == 4
    too_long = CliRunner().invoke(main, [*args, "--prefill", "300"])  # more than a server round's piece: click's range
    assert too_long.exit_code == 2 and "Invalid value for '--prefill': 300 is not in the range 0<=x<=256" in too_long.output
    from quasar_deploy.bench.batched_step import batched_step
    from quasar_deploy.errors import QuasarError

    with pytest.raises(QuasarError, match="a prefill piece is 0 to 256 tokens"):  # the API's own bound, before loading
        batched_step(str(tiny_artifact.path), prefill=300)
    for bad in (["--backends", "tpu"], ["--sequences", "0"]):
        refused = CliRunner().invoke(main, [*args, *bad])
        assert refused.exit_code == 1 and refused.output.startswith("error: --") and len(refused.output.strip().splitlines()) == 1
    both = json.loads(CliRunner().invoke(main, [*args, "--backends", "onnxruntime,onnxruntime-gqa", "--json"]).output)["figures"]
    assert "attention: ORT GroupQueryAttention" in both["descriptions"]["onnxruntime-gqa"]
    assert set(both["ms"]) == {"onnxruntime", "onnxruntime-gqa"}


def test_bench_kernels_names_its_kernels():
    """Unknown int8 kernels are refused in one line; other kernels' times print beside the first's."""
    from quasar_deploy.bench.micro import describe_linear_kernels

    from .helpers import assert_one_line_error

    assert_one_line_error(CliRunner().invoke(main, ["bench", "kernels", "--int8-kernels", "reference,fast"]), "unknown kernel 'fast'")
    row = {"out_features": 8, "in_features": 4, "m": 6, "float_ms": 2.0, "w8a8_ms": 1.0, "speedup": 2.0}
    row |= {"float_fraction_of_bound": 0.5, "w8a8_fraction_of_bound": 0.4, "other_int8_ms": {"fbgemm-vnni": 1.25}}
    result = {"shape": "s", "float_kernel": "onednn", "float_dtype": "bfloat16", "int8_kernel": "onednn-vnni"}
    result |= {"int8_kernel_label": "onednn-vnni", "other_int8_kernels": ["fbgemm-vnni"]}
    text = describe_linear_kernels(result | {"threads": 2, "bandwidth_gb_s": 20.0, "rows": [row]})
    assert "float onednn in bfloat16" in text.splitlines()[0]
    assert "fbgemm-vnni ms" in text.splitlines()[1] and text.splitlines()[2].endswith("1.250")


def test_speedups_are_also_modelled_at_the_papers_acceptance():
    """A speculative mode's step cost at L = 1.4 tokens per step, against the best float mode modelled alike; an
    autoregressive mode keeps its measured speed."""
    from quasar_deploy.bench.e2e import PAPER_ACCEPTANCE, _at_paper_acceptance

    step = 1 / 40  # 40 steps a second
    figures = {
        "ar-float": {"tokens_per_s": 30.0, "acceptance_length": 1.0},
        "ngram-float": {"tokens_per_s": 90.0, "acceptance_length": 3.0, "tokens_per_s_at_paper_acceptance": PAPER_ACCEPTANCE / step},
        "ngram-w8a8": {"tokens_per_s": 150.0, "acceptance_length": 3.0, "tokens_per_s_at_paper_acceptance": PAPER_ACCEPTANCE / (step / 2)},
    }
    figures["llamacpp-q8_0"] = {"tokens_per_s": 70.0, "acceptance_length": None}  # an anchor: no step cost to model
    _at_paper_acceptance(figures, ["ar-float", "ngram-float"])
    assert "speedup_vs_best_float_at_paper_acceptance" not in figures["llamacpp-q8_0"]
    assert figures["ngram-float"]["speedup_vs_best_float_at_paper_acceptance"] == pytest.approx(1.0)  # 56 tok/s beats 30
    assert figures["ngram-w8a8"]["speedup_vs_best_float_at_paper_acceptance"] == pytest.approx(2.0)
    assert figures["ar-float"]["speedup_vs_best_float_at_paper_acceptance"] == pytest.approx(30 / 56)


def test_repeats_run_each_mode_on_each_prompt_and_keep_its_median_run(pair, tmp_path, monkeypatch):
    from quasar_deploy.bench import e2e
    from quasar_deploy.bench.contenders import trained_contenders

    speeds = iter([5.0, 1.0, 3.0, 9.0, 2.0, 4.0] * 4)
    calls = []

    def run_mode(mode, contenders, ids, settings):
        calls.append((mode, settings.max_new_tokens))
        return e2e.Run([1, 2], next(speeds) if settings.max_new_tokens == 8 else 1.0, 1.0)

    monkeypatch.setattr(e2e, "run_mode", run_mode)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"turns": ["def f(x):"]}\n{"turns": ["class A:"]}\n')
    settings = e2e.BenchSettings(prompts=str(prompts), limit=2, repeats=3, max_new_tokens=8, modes=("ar-float", "ngram-float"))
    report = e2e.benchmark(settings, trained_contenders(*pair), progress=False)
    timed = [mode for mode, tokens in calls if tokens == 8]
    assert len(timed) == 2 * 2 * 3 and timed.count("ar-float") == timed.count("ngram-float") == 6
    # the order turns each repeat and each prompt. Prompt 0 runs ar ngram, ngram ar, ar ngram on speeds 5 1 3 9 2 4:
    # ar-float {5, 9, 2} -> 5, ngram-float {1, 3, 4} -> 3; prompt 1 runs ngram ar, ar ngram, ngram ar: ar {1, 3, 4} -> 3
    ar, ngram = report["modes"]["ar-float"], report["modes"]["ngram-float"]
    assert (ar["tokens_per_s_min"], ar["tokens_per_s_max"], ngram["tokens_per_s_min"], ngram["tokens_per_s_max"]) == (3.0, 5.0, 3.0, 5.0)
    assert report["settings"]["repeats"] == 3
    assert e2e.median_run([e2e.Run([], s, 1.0) for s in (4.0, 1.0, 3.0, 2.0)]).tokens_per_s == 2.0
