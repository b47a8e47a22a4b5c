"""Tiny random models saved as real Hugging Face checkpoints (fixed seeds), for tests."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from quasar_deploy import demo_model_path
from quasar_deploy.artifact import open_model_files
from quasar_deploy.scheme import quantize_weight

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
