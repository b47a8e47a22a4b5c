"""Function-preserving inflation: the inflated float model's logits are the source's, the inflated W8A8 artifact decodes the
calibrated artifact's tokens, and both load through the normal paths. Targets are small here (2x width, a few extra layers);
the demo's 0.6B body differs only in size."""

import json

import pytest
import torch

from quasar_deploy import calibrate, demo_model_path, load
from quasar_deploy.artifact import open_model_files
from quasar_deploy.errors import QuasarError
from quasar_deploy.inflate import InflationTarget, body_of, inflate_artifact, inflate_checkpoint
from quasar_deploy.scheme import quantize_weight

from .helpers import FAST_CALIBRATION

# demo model: hidden 256, MLP 768, 6 layers, 4 query / 2 KV heads of 64
TARGET = InflationTarget(hidden_size=512, intermediate_size=1536, num_layers=8, num_heads=8, num_kv_heads=4)
PROMPTS = ["import os\n\n\ndef list_python_files(root):\n", "class Stack:\n    def __init__(self):\n", "def fibonacci(n):\n"]
# float32 logits of the demo model reach ~12; summing extra zero terms in another order moves them by ~1e-5
LOGIT_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def inflated(tmp_path_factory):
    """(demo artifact, inflated float model, inflated artifact), fast calibration."""
    root = tmp_path_factory.mktemp("inflated")
    artifact = calibrate(demo_model_path(), root / "demo-w8a8", **FAST_CALIBRATION).path
    model = inflate_checkpoint(demo_model_path(), root / "float", TARGET, progress=False)
    return artifact, model, inflate_artifact(artifact, root / "w8a8", TARGET, model, progress=False)


def _logits(path, ids: torch.Tensor) -> torch.Tensor:
    decoder = open_model_files(path).decoder()
    cache = decoder.new_cache()
    prefill = decoder(ids[:-6], cache)
    return torch.cat([prefill, decoder(ids[-6:], cache)])  # a prefill, then a 6-token verify block on the cache


def test_inflated_float_logits_equal_the_source(inflated):
    ids = torch.arange(100, 164)
    source, big = _logits(demo_model_path(), ids), _logits(inflated[1], ids)
    assert (source - big).abs().max() < LOGIT_TOLERANCE
    assert torch.equal(source.argmax(-1), big.argmax(-1))


def test_untied_lm_head_and_float32_source(tiny_qwen3, tmp_path):
    target = InflationTarget(hidden_size=128, intermediate_size=200, num_layers=5, num_heads=6, num_kv_heads=3)
    big = inflate_checkpoint(tiny_qwen3, tmp_path / "big", target, progress=False)
    spec = open_model_files(big).spec
    assert (spec.hidden_size, spec.num_layers, spec.num_heads, spec.tie_word_embeddings) == (128, 5, 6, False)
    ids = torch.arange(10, 40)
    assert (_logits(tiny_qwen3, ids) - _logits(big, ids)).abs().max() < LOGIT_TOLERANCE


def test_inflated_w8a8_decodes_the_calibrated_artifacts_tokens(inflated):
    artifact, _, big = inflated
    small_engine, big_engine = load(artifact, backend="cpu"), load(big, backend="cpu")
    assert big_engine.lm.spec.hidden_size == 512
    for prompt in PROMPTS:
        a = small_engine.generate(prompt, max_new_tokens=48, draft="ngram", num_draft=5)
        b = big_engine.generate(prompt, max_new_tokens=48, draft="ngram", num_draft=5)
        assert a.tokens == b.tokens
        assert a.stats.acceptance_length == b.stats.acceptance_length and a.stats.verify_steps == b.stats.verify_steps


def test_inflated_artifact_is_a_checked_artifact_that_says_what_it_is(inflated):
    artifact, model, big = inflated
    files = open_model_files(big)  # every file's sha256 against the manifest, the record, the activation mode
    record = files.manifest
    assert record["format_version"] == 2 and "not a calibration of random weights" in record["inflation"]["what"]
    assert record["source"]["path"] == str(model) and record["source"]["sha256"] == open_model_files(model).checkpoint.fingerprint()
    assert record["inflation"]["artifact"] == str(artifact) and record["inflation"]["target"] == TARGET.to_dict()
    assert set(record["quantized_layers"]) == {name for name, _ in files.decoder().linears()}
    config = json.loads((big / "config.json").read_text())
    assert config["quantization_config"]["ignore"] == ["lm_head"]
    assert config["hidden_size"] == 512 and "layer_types" not in config


def test_random_rows_of_the_artifact_quantize_the_float_models(inflated):
    _, model, big = inflated
    name = "model.layers.7.self_attn.q_proj.weight"
    float_weight = open_model_files(model).checkpoint.tensor(name)
    wq, scale = quantize_weight(float_weight)
    stored = open_model_files(big).checkpoint
    assert torch.equal(stored.tensor(name), wq)
    assert torch.equal(stored.tensor(name.replace("weight", "weight_scale")), scale)


def test_new_layers_add_nothing_to_the_residual_stream(inflated):
    checkpoint = open_model_files(inflated[2]).checkpoint
    for kind in ("self_attn.o_proj", "mlp.down_proj"):
        assert not checkpoint.tensor(f"model.layers.6.{kind}.weight").any()
    assert not checkpoint.tensor("model.layers.0.self_attn.v_proj.weight")[128:].any()  # extra KV heads' values
    assert not checkpoint.tensor("model.layers.0.mlp.up_proj.weight")[768:].any()  # extra MLP channels


def test_qwen3_0_6b_body_keeps_the_demo_head_dim():
    target = body_of("qwen3-0.6b", open_model_files(demo_model_path()).spec)
    assert target == InflationTarget(hidden_size=1024, intermediate_size=3072, num_layers=28, num_heads=32, num_kv_heads=16)


@pytest.mark.parametrize(
    "target, message",
    [
        (InflationTarget(300, 1536, 8, 8, 4), "not a multiple"),
        (InflationTarget(512, 512, 8, 8, 4), "intermediate_size 512 is below"),
        (InflationTarget(512, 1536, 8, 8, 2), "query heads per KV head"),
    ],
)
def test_targets_that_cannot_hold_the_function_are_refused(tmp_path, target, message):
    with pytest.raises(QuasarError, match=message):
        inflate_checkpoint(demo_model_path(), tmp_path / "out", target, progress=False)
    assert not (tmp_path / "out").exists()


def test_wrong_inputs_are_refused(inflated, tmp_path):
    artifact, model, _ = inflated
    with pytest.raises(QuasarError, match="inflate_artifact"):
        inflate_checkpoint(artifact, tmp_path / "a", TARGET, progress=False)
    with pytest.raises(QuasarError, match="not a W8A8 artifact"):
        inflate_artifact(model, tmp_path / "b", TARGET, model, progress=False)
    with pytest.raises(QuasarError, match="its shape differs"):
        inflate_artifact(artifact, tmp_path / "c", TARGET, demo_model_path(), progress=False)
