"""Real-size Hugging Face checkpoints of published shapes with random weights, written without holding the model.

An 8B model's calibration, export and serving must be testable without downloading one, reading shards included: this
writes what ``save_pretrained`` would, plus the demo tokenizer (in every shape's vocabulary). Outputs mean nothing."""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import torch
from tqdm import tqdm

from ..decoder_spec import DecoderSpec, expected_shapes
from ..demo import demo_model_path
from ..errors import QuasarError
from ..files import TOKENIZER_FILES, atomic_directory, copy_files, require_new
from ..shards import MAX_SHARD_SIZE, ShardWriter
from .synthetic import synthetic_spec

BLOCK_BYTES = 1 << 26  # float32 bytes generated at a time
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0,
    "max_position_embeddings": 40960, "bos_token_id": 151643, "eos_token_id": 151645,
}  # fmt: skip
_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "rms_norm_eps": 1e-5}
# the config fields beyond the dimensions (which come from synthetic.SHAPES), as the published configs give them
FAMILIES = {
    **dict.fromkeys(("qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b"), _QWEN3),
    "llama-3-8b": {**_LLAMA, "rope_theta": 500_000.0, "max_position_embeddings": 8192, "bos_token_id": 128000, "eos_token_id": 128001},
    # Llama layout (openPangu's own class is Llama-like); the 32k context is published, rope_theta, eps and ids assumed
    "openpangu-7b-like": {**_LLAMA, "rope_theta": 16_000_000.0, "max_position_embeddings": 32768, "bos_token_id": 1, "eos_token_id": 45892},
}


def checkpoint_spec(shape: str, layers: int | None = None) -> DecoderSpec:
    """The decoder a checkpoint of ``shape`` holds; ``layers`` overrides its depth (tests, quick runs)."""
    if shape not in FAMILIES:
        raise QuasarError(f"unknown checkpoint shape {shape!r}; choose from {', '.join(FAMILIES)}")
    if layers is not None and layers < 1:
        raise QuasarError(f"--layers must be >= 1, not {layers}")
    spec = synthetic_spec(shape)
    return spec if layers is None else replace(spec, num_layers=layers)


def hf_config(shape: str, spec: DecoderSpec, dtype: str) -> dict:
    """``config.json`` as the architecture's own config class would write it, with ``spec``'s dimensions."""
    return {
        **FAMILIES[shape],
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "torch_dtype": dtype,
    }


def tensor_shapes(spec: DecoderSpec) -> dict[str, tuple[int, ...]]:
    """Every weight in ``state_dict`` order (embeddings, layers, final norm, lm_head), so shards split as HF's do."""
    shapes = {name: shape for name, shape in expected_shapes(spec).items() if name.endswith(".weight")}
    last = [name for name in ("model.norm.weight", "lm_head.weight") if name in shapes]
    return {name: shape for name, shape in shapes.items() if name not in last} | {name: shapes[name] for name in last}


def checkpoint_bytes(spec: DecoderSpec, dtype: str) -> int:
    return sum(math.prod(shape) for shape in tensor_shapes(spec).values()) * DTYPES[dtype].itemsize


def _blocks(shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator) -> Iterator[torch.Tensor]:
    """A weight as row blocks of normal(0, 0.02) (a norm: ones), generated in float32 a block at a time."""
    if len(shape) == 1:
        yield torch.ones(shape, dtype=dtype)
        return
    step = max(1, BLOCK_BYTES // (4 * math.prod(shape[1:])))
    for start in range(0, shape[0], step):
        rows = min(step, shape[0] - start)
        yield (torch.randn((rows, *shape[1:]), generator=generator) * 0.02).to(dtype)


def _refuse_if_no_space(output: Path, needed: int) -> None:
    """Before any write: a disk filling up at shard 3 of 4 costs the minutes spent generating."""
    parent = output.parent
    while not parent.exists():
        parent = parent.parent
    free = shutil.disk_usage(parent).free
    if free < needed:
        raise QuasarError(f"{parent}: {free / 1e9:.1f} GB free, writing {output.name} needs about {needed / 1e9:.1f} GB")


def write_synthetic_checkpoint(
    shape: str,
    output: str | Path,
    dtype: str = "bfloat16",
    max_shard_size: int = MAX_SHARD_SIZE,
    seed: int = 0,
    layers: int | None = None,
    progress: bool = True,
) -> Path:
    """Write a random-weight checkpoint of a published ``shape`` to ``output`` (atomically); returns ``output``."""
    if dtype not in DTYPES:
        raise QuasarError(f"--dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    spec = checkpoint_spec(shape, layers)
    output = require_new(output)
    total = checkpoint_bytes(spec, dtype)
    _refuse_if_no_space(output, total + min(total, max_shard_size))  # a shard's scratch bytes sit beside it until it closes
    generator = torch.Generator().manual_seed(seed)
    with atomic_directory(output) as tmp:
        writer = ShardWriter(tmp, max_shard_size)
        for name, tensor_shape in tqdm(tensor_shapes(spec).items(), desc=f"writing {shape}", unit="tensor", disable=not progress):
            writer.add_blocks(name, DTYPES[dtype], tensor_shape, _blocks(tensor_shape, DTYPES[dtype], generator))
        writer.close()
        (tmp / "config.json").write_text(json.dumps(hf_config(shape, spec, dtype), indent=2))
        # not generation_config.json: its token ids are the demo model's, not the architecture's
        copy_files(demo_model_path(), tmp, [name for name in TOKENIZER_FILES if name != "generation_config.json"])
    return output
