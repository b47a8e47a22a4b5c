"""Builders of tiny random models saved as real Hugging Face checkpoints (fixed seeds), and of artifacts from them.

The session fixtures in conftest.py build each of these once; tests that need a variant build it here into ``tmp_path``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from quasar_deploy import demo_model_path
from quasar_deploy.artifact import open_model_files, writing_artifact
from quasar_deploy.checkpoint import Checkpoint
from quasar_deploy.model import Decoder
from quasar_deploy.scheme import W8A8Scheme, quantize_weight

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def save_tiny(
    path: Path, arch: str = "qwen3", seed: int = 0, dtype: torch.dtype | None = None, max_shard_size: int | str = "5GB", **overrides
) -> Path:
    """A random-weight decoder of the given family, with the demo model's tokenizer beside it (``dtype``: stored as; default float32)."""
    import transformers

    families = {
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
        "llama": ("LlamaConfig", "LlamaForCausalLM"),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
        "mistral": ("MistralConfig", "MistralForCausalLM"),
    }
    config_cls, model_cls = (getattr(transformers, n) for n in families[arch])
    settings = dict(
        vocab_size=4096,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        eos_token_id=0,
        bos_token_id=0,
        pad_token_id=0,
    )
    settings.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**settings))
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(path, max_shard_size=max_shard_size)
    for name in TOKENIZER_FILES:
        if (demo_model_path() / name).exists():
            shutil.copy2(demo_model_path() / name, path / name)
    return path


def naive_w8a8_decoder(path: Path, int8_kernel: str = "reference"):
    """A W8A8 decoder without calibration (no smoothing): for tests that need any W8A8 verifier."""
    decoder = open_model_files(path).decoder()
    for _, linear in decoder.linears():
        wq, scale = quantize_weight(linear.weight.data)
        linear.set_quantized(wq, scale, None)
    decoder.prepare("torch", int8_kernel)
    return decoder


def write_artifact(decoder: Decoder, source: Checkpoint, output: Path, scheme: W8A8Scheme, manifest: dict) -> Path:
    """Write a decoder held in memory (quantized by the caller) as an artifact; ``calibrate`` streams layer by layer instead."""
    with writing_artifact(source, output) as writer:
        for name, tensor in decoder.state_dict().items():
            if not (name == "lm_head.weight" and decoder.spec.tie_word_embeddings and not decoder.lm_head.quantized):
                writer.add(name, tensor)
        writer.finish(scheme, [name for name, linear in decoder.linears() if not linear.quantized], manifest)
    return Path(output)


def write_naive_artifact(model: Path, output: Path) -> Path:
    """A W8A8 artifact of ``model`` without calibration (naive weight quantization): enough to load a W8A8 verifier."""
    decoder = naive_w8a8_decoder(model)
    quantized = [name for name, linear in decoder.linears() if linear.quantized]
    manifest = {"recipe": {"scheme": W8A8Scheme().to_dict()}, "quantized_layers": quantized}
    return write_artifact(decoder, Checkpoint(model), output, W8A8Scheme(), manifest)


def save_tiny_qwen2_with_biases(path: Path) -> Path:
    """Qwen2 has q/k/v biases (zero at init; made nonzero here): they exercise ``bias`` and the npu export's ``quant_bias``."""
    from safetensors.torch import load_file, save_file

    save_tiny(path, "qwen2", seed=2)
    weights = load_file(path / "model.safetensors")
    generator = torch.Generator().manual_seed(2)
    for name, tensor in weights.items():
        if name.endswith(".bias"):
            weights[name] = torch.randn(tensor.shape, generator=generator).to(tensor.dtype) * 0.2
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path
