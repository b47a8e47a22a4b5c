"""Plant the activation outliers that 7B-scale LLMs have into a small model, without changing its function.

Small models lack the few huge hidden channels that make naive W8A8 fail, so they cannot show what smoothing buys. For
chosen channels we multiply the RMSNorm weight by f and divide the input columns of the linears it feeds by f (likewise
up_proj rows and down_proj columns for MLP channels); with f a power of two the float model's logits are unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from .checkpoint import Checkpoint
from .decoder_spec import decoder_spec
from .files import atomic_directory, copy_files


def outlier_tensors(checkpoint: Checkpoint, factor: float = 64.0, hidden_channels: int = 4, inner_channels: int = 8, seed: int = 0) -> dict:
    spec = decoder_spec(checkpoint.config, checkpoint.names)
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randperm(spec.hidden_size, generator=generator)[:hidden_channels]
    inner = torch.randperm(spec.intermediate_size, generator=generator)[:inner_channels]
    tensors = {name: checkpoint.tensor(name).float() for name in checkpoint.names}
    for i in range(spec.num_layers):
        p = spec.layer_prefix(i)
        feeds = {
            f"{p}.input_layernorm.weight": [f"{p}.self_attn.{n}.weight" for n in ("q_proj", "k_proj", "v_proj")],
            f"{p}.post_attention_layernorm.weight": [f"{p}.mlp.{n}.weight" for n in ("gate_proj", "up_proj")],
        }
        for norm, linears in feeds.items():
            tensors[norm][hidden] *= factor
            for name in linears:
                tensors[name][:, hidden] /= factor
        tensors[f"{p}.mlp.up_proj.weight"][inner] *= factor
        if f"{p}.mlp.up_proj.bias" in tensors:
            tensors[f"{p}.mlp.up_proj.bias"][inner] *= factor
        tensors[f"{p}.mlp.down_proj.weight"][:, inner] /= factor
    return tensors


def write_outlier_variant(source: str | Path, output: str | Path, factor: float = 64.0) -> Path:
    """A float32 HF checkpoint at ``output`` computing the same function as ``source``, with outlier channels."""
    checkpoint = Checkpoint(source)
    output = Path(output)
    tensors = outlier_tensors(checkpoint, factor)
    if checkpoint.config.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)
    with atomic_directory(output) as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config = dict(checkpoint.config, torch_dtype="float32", dtype="float32")
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        copy_files(checkpoint.path, tmp)
    return output
