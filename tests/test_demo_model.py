"""The shipped demo model is a real trained model, and its outlier variant behaves as promised."""

import json

import pytest
import torch

from quasar_deploy import calibrate, demo_model_path, evaluate
from quasar_deploy.artifact import open_model_files
from quasar_deploy.tokenizer import load_tokenizer


def test_shipped_files_and_size():
    path = demo_model_path()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json", "README.md", "training.json"):
        assert (path / name).is_file(), name
    assert sum(f.stat().st_size for f in path.iterdir()) < 25 * 2**20
    assert json.loads((path / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]


def test_trained_far_below_unigram():
    facts = json.loads((demo_model_path() / "training.json").read_text())
    held_out = float(facts["held-out loss / perplexity"].split("/")[0])
    unigram = float(facts["unigram baseline loss / perplexity"].split("/")[0])
    assert held_out < unigram - 2.0


def test_greedy_continuation_looks_like_python():
    tokenizer = load_tokenizer(open_model_files(demo_model_path()))
    decoder = open_model_files(demo_model_path()).decoder()
    ids = tokenizer("import os\n\n\ndef list_files(path):\n")["input_ids"]
    cache = decoder.new_cache()
    logits = decoder(torch.tensor(ids), cache)[-1]
    out = []
    for _ in range(40):
        token = int(logits.argmax())
        out.append(token)
        logits = decoder(torch.tensor([token]), cache)[-1]
    text = tokenizer.decode(out)
    assert "    " in text and any(word in text for word in ("return", "for ", "if ", "os.", "path"))


@pytest.mark.slow
def test_outlier_variant_preserves_float_and_hurts_naive_w8a8(tmp_path):
    plain, outlier = demo_model_path(), demo_model_path("outlier")
    ids = torch.arange(100, 164)
    a, b = open_model_files(plain).decoder(), open_model_files(outlier).decoder()
    assert torch.equal(a(ids, a.new_cache()), b(ids, b.new_cache()))
    kl = {}
    for name, model in (("plain", plain), ("outlier", outlier)):
        for alpha in ("off", "auto"):
            artifact = calibrate(model, tmp_path / f"{name}-{alpha}", num_samples=8, seq_len=128, alpha=alpha, progress=False)
            kl[name, alpha] = evaluate(artifact.path, model, num_samples=6, seq_len=128, progress=False).mean_kl
    assert kl["outlier", "off"] > 20 * kl["plain", "off"]
    assert kl["outlier", "auto"] < kl["outlier", "off"] / 20
