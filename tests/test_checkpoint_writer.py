"""Synthetic real-size checkpoints load like downloaded ones: our loader, transformers' config and tokenizer, and calibration."""

import json

import pytest
from click.testing import CliRunner

from quasar_deploy import QuasarError, calibrate
from quasar_deploy.artifact import open_model_files
from quasar_deploy.bench import checkpoint_writer
from quasar_deploy.bench.checkpoint_writer import FAMILIES, checkpoint_spec, hf_config, tensor_shapes, write_synthetic_checkpoint
from quasar_deploy.cli import main
from quasar_deploy.decoder_spec import check_tensor_shapes, decoder_spec
from quasar_deploy.shards import INDEX


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """qwen3-0.6b at 2 layers, 40 MB shards: the 311 MB embedding alone, then one layer per shard."""
    path = tmp_path_factory.mktemp("synthetic") / "qwen3"
    args = ["bench", "write-checkpoint", "qwen3-0.6b", "-o", str(path), "--layers", "2", "--max-shard-size", str(40 * 10**6)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    return path


def test_written_checkpoint_is_sharded_and_opens(written):
    index = json.loads((written / INDEX).read_text())
    assert sorted(set(index["weight_map"].values())) == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    model = open_model_files(written)
    assert (model.spec.num_layers, model.spec.hidden_size, model.spec.vocab_size, model.spec.qk_norm) == (2, 1024, 151936, True)
    assert set(model.checkpoint.dtypes.values()) == {"BF16"}
    assert index["metadata"]["total_size"] == checkpoint_writer.checkpoint_bytes(checkpoint_spec("qwen3-0.6b", 2), "bfloat16")


def test_transformers_reads_config_and_tokenizer(written):
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(written)
    assert type(config).__name__ == "Qwen3Config" and config.num_hidden_layers == 2 and config.tie_word_embeddings
    assert len(AutoTokenizer.from_pretrained(written)) <= config.vocab_size


def test_calibrates(written, tmp_path):
    artifact = calibrate(written, tmp_path / "w8a8", num_samples=2, seq_len=16, alpha=0.5, progress=False)
    assert len(artifact.manifest["quantized_layers"]) == 2 * 7


@pytest.mark.parametrize("shape", sorted(FAMILIES))
def test_every_shape_config_matches_its_tensors(shape, tmp_path):
    """Full depth, without writing weights: transformers knows the architecture and our loader accepts config + shapes."""
    from transformers import AutoConfig

    spec = checkpoint_spec(shape)
    config = hf_config(shape, spec, "bfloat16")
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert AutoConfig.from_pretrained(tmp_path).architectures == config["architectures"]
    shapes = tensor_shapes(spec)
    check_tensor_shapes(decoder_spec(config, set(shapes)), shapes)
    assert list(shapes)[0] == "model.embed_tokens.weight" and ("lm_head.weight" in shapes) != spec.tie_word_embeddings


def test_refusals_are_one_line_and_write_nothing(tmp_path, monkeypatch):
    with pytest.raises(QuasarError, match="unknown checkpoint shape"):
        write_synthetic_checkpoint("qwen3-70b", tmp_path / "x")
    with pytest.raises(QuasarError, match="--dtype"):
        write_synthetic_checkpoint("qwen3-0.6b", tmp_path / "x", dtype="int8")
    monkeypatch.setattr(checkpoint_writer.shutil, "disk_usage", lambda _: type("Usage", (), {"free": 10**9})())
    with pytest.raises(QuasarError, match=r"1\.0 GB free, writing x needs about 21\.\d GB"):
        write_synthetic_checkpoint("qwen3-8b", tmp_path / "x")
    assert list(tmp_path.iterdir()) == []
