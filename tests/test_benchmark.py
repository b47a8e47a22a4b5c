"""Benchmark smoke test (not a timing test): every mode runs, the report is complete, lossless modes are lossless."""

import json

import pytest
import torch
from click.testing import CliRunner

from quasar_deploy import calibrate
from quasar_deploy.artifact import open_model
from quasar_deploy.bench.contenders import _hf_twin
from quasar_deploy.bench.e2e import MODES
from quasar_deploy.cli import main


@pytest.fixture(scope="module")
def pair(tiny_qwen3, tmp_path_factory):
    artifact = calibrate(tiny_qwen3, tmp_path_factory.mktemp("bench") / "w8a8", num_samples=4, seq_len=32, progress=False)
    return tiny_qwen3, artifact.path


def test_every_mode_reports_and_lossless_holds(pair, tmp_path):
    model, artifact = pair
    out = tmp_path / "report"
    result = CliRunner().invoke(
        main, ["bench", str(model), str(artifact), "--limit", "2", "--max-new-tokens", "8", "--out", str(out), "--sweep-k", "2,4"]
    )
    assert result.exit_code == 0, result.output
    report = json.loads((out / "report.json").read_text())
    assert set(report) >= {"settings", "environment", "modes", "lossless", "sweep_k"}
    assert list(report["modes"]) == list(MODES)
    for mode, figures in report["modes"].items():
        assert figures["tokens_per_s"] > 0 and figures["new_tokens"] > 0, mode
        assert "speedup_vs_ngram-float" in figures and "speedup_vs_ar-float" in figures
    assert report["modes"]["ngram-w8a8"]["acceptance_length"] >= 1.0
    assert report["lossless"] and all(report["lossless"].values())
    assert report["environment"]["torch"] == torch.__version__
    for name in ("report.md", "tokens_per_s.png", "acceptance_length.png", "speedup_vs_k.png"):
        assert (out / name).stat().st_size > 0, name


def test_sampled_benchmark_runs(pair, tmp_path):
    model, artifact = pair
    args = ["bench", str(model), str(artifact), "--limit", "1", "--max-new-tokens", "6", "--temperature", "1"]
    args += ["--modes", "ngram-float,ngram-w8a8"]
    result = CliRunner().invoke(main, [*args, "--out", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    assert "lossless" not in json.loads(result.output)


def test_bench_needs_a_model_pair(tmp_path):
    result = CliRunner().invoke(main, ["bench", "--out", str(tmp_path)])
    assert result.exit_code == 1 and "give MODEL" in result.output


def test_hf_twin_shares_our_weights(tiny_qwen3):
    decoder = open_model(tiny_qwen3).decoder()
    twin = _hf_twin(decoder)
    ids = torch.arange(5, 30)
    with torch.no_grad():
        expected = twin(ids[None]).logits[0]
    torch.testing.assert_close(decoder(ids, decoder.new_cache()), expected, atol=2e-5, rtol=1e-4)
