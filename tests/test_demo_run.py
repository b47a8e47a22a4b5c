"""``quasar-deploy demo`` end to end, on a small inflation target: what it prints and that the inflated model decodes the demo's tokens."""

import pytest

from quasar_deploy import demo
from quasar_deploy.artifact import open_model_files
from quasar_deploy.backends import registry
from quasar_deploy.calibration import CalibrationRecipe
from quasar_deploy.calibration.data import BUILTIN, read_texts
from quasar_deploy.demo.needs import demo_needs, model_headers
from quasar_deploy.demo.run import describe, run_demo
from quasar_deploy.inflate import InflationTarget

SMALL = InflationTarget(hidden_size=512, intermediate_size=1536, num_layers=7, num_heads=8, num_kv_heads=4)


@pytest.mark.slow
def test_demo_measures_the_inflated_and_the_demo_model(monkeypatch, tmp_path):
    monkeypatch.setenv("QUASAR_CACHE", str(tmp_path))
    monkeypatch.setattr(demo, "demo_recipe", lambda: CalibrationRecipe(num_samples=8, seq_len=64))
    monkeypatch.setattr(demo, "inflation_target", lambda: SMALL)
    monkeypatch.setattr(registry, "cpu_runs_better", lambda artifact: False)  # a library int8 kernel, float32: auto runs ORT
    printed = []
    package = sorted(demo.demo_model_path().parent.iterdir())
    prompts = read_texts(BUILTIN["prompts"])[:2]
    before = demo_needs(prompts, 16, True)
    result = run_demo(printed.append, progress=False, limit=2, max_new_tokens=16)
    text = "".join(printed)
    assert sorted(demo.demo_model_path().parent.iterdir()) == package  # everything derived goes to the cache
    assert "first run: calibrating (cached afterwards)" in text and "first run: inflating" in text
    inflated, small = result["inflated"]["modes"], result["demo"]["modes"]
    # the same tokens, so the same acceptance on every prompt (ONNX Runtime's float parts round differently: not asserted)
    assert inflated["ngram-w8a8"]["acceptance_lengths"] == small["ngram-w8a8"]["acceptance_lengths"]
    summary = describe(result)
    assert "demo model inflated function-preservingly to the Qwen3-0.6B body shape (the same function: outputs equal" in summary
    assert "int8 kernel" in summary and "median over 2 prompts of the per-prompt ratio" in summary
    assert "(backend auto) runs W8A8 here on onnxruntime (the ngram-w8a8-ort rows)" in summary
    paths = demo.inflated_demo_paths()
    # the headers needs.py predicted before the first run are the ones it wrote, and what it wrote is what it said
    source = open_model_files(demo.demo_model_path())
    for path, w8a8 in zip(paths, (False, True)):
        written = open_model_files(path)
        assert written.spec.num_layers == SMALL.num_layers
        shapes, dtypes = model_headers(written.spec, source.checkpoint.dtypes, w8a8)
        assert ({n: tuple(s) for n, s in written.checkpoint.shapes.items()}, written.checkpoint.dtypes) == (shapes, dtypes)
    cache = [p for p in tmp_path.iterdir() if p.name.startswith(("demo-", "onnx-"))]
    written_bytes = sum(f.stat().st_size for p in cache for f in p.rglob("*") if f.is_file())
    assert 0.9 * written_bytes < before.disk <= written_bytes and demo_needs(prompts, 16, True).disk == 0
    stamps = [p.stat().st_mtime_ns for p in paths]
    assert demo.inflated_demo(progress=False) == paths and [p.stat().st_mtime_ns for p in paths] == stamps  # cached
