"""Per-architecture facts: the decoder's shape and which norm or linear feeds which linears.

Llama, Mistral, Qwen2, Qwen3 and Llama-like checkpoints such as OpenPangu share one
tensor layout (``model.layers.N.self_attn.q_proj`` ...). We map by those names, and
read the optional parts (QK-norm, biases) from which tensors the checkpoint has,
so a new Llama-like architecture needs no code here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .errors import QuasarError

KNOWN_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "PanguEmbeddedForCausalLM",
)
ATTENTION_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class SmoothGroup:
    """Linears sharing one input; ``source`` (a norm or a linear) absorbs the smoothing scale.

    ``source`` is None where no exact fold exists (o_proj under grouped-query attention):
    those linears are quantized unsmoothed.
    """

    name: str
    source: str | None
    source_kind: str  # "norm", "linear" or "none"
    linears: tuple[str, ...]


@dataclass(frozen=True)
class DecoderSpec:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qk_norm: bool
    sliding_window: int | None
    extra: dict = field(default_factory=dict, compare=False)

    def layer_prefix(self, i: int) -> str:
        return f"model.layers.{i}"

    def linear_names(self) -> list[str]:
        names = []
        for i in range(self.num_layers):
            p = self.layer_prefix(i)
            names += [f"{p}.self_attn.{n}" for n in ATTENTION_LINEARS]
            names += [f"{p}.mlp.{n}" for n in MLP_LINEARS]
        return names

    def smooth_groups(self) -> list[SmoothGroup]:
        groups = []
        for i in range(self.num_layers):
            p = self.layer_prefix(i)
            attn, mlp = f"{p}.self_attn", f"{p}.mlp"
            groups.append(
                SmoothGroup(f"{p}.qkv", f"{p}.input_layernorm", "norm", tuple(f"{attn}.{n}" for n in ("q_proj", "k_proj", "v_proj")))
            )
            if self.num_kv_heads == self.num_heads:
                groups.append(SmoothGroup(f"{p}.o", f"{attn}.v_proj", "linear", (f"{attn}.o_proj",)))
            else:
                groups.append(SmoothGroup(f"{p}.o", None, "none", (f"{attn}.o_proj",)))
            groups.append(SmoothGroup(f"{p}.gate_up", f"{p}.post_attention_layernorm", "norm", (f"{mlp}.gate_proj", f"{mlp}.up_proj")))
            groups.append(SmoothGroup(f"{p}.down", f"{mlp}.up_proj", "linear", (f"{mlp}.down_proj",)))
        return groups


def _rope(config: dict) -> tuple[float, dict | None]:
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or None
    theta = config.get("rope_theta", params.get("rope_theta", 10000.0))
    if scaling is None and params.get("rope_type", "default") != "default":
        scaling = params
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind not in ("default", "linear", "llama3"):
            raise QuasarError(f"unsupported rope scaling {kind!r} (supported: default, linear, llama3)")
        if kind == "default":
            scaling = None
    return float(theta), scaling


def decoder_spec(config: dict, tensor_names: set[str]) -> DecoderSpec:
    """Read a Hugging Face config; refuse, in one line, what the shared decoder cannot run."""
    archs = config.get("architectures") or [config.get("model_type", "unknown")]
    arch = archs[0]
    if "model.layers.0.self_attn.q_proj.weight" not in tensor_names or "model.embed_tokens.weight" not in tensor_names:
        raise QuasarError(
            f"unsupported architecture {arch!r}: quasar-deploy runs Llama-like decoders "
            f"({', '.join(KNOWN_ARCHITECTURES)}) whose weights follow the model.layers.N.self_attn.q_proj layout"
        )
    if config.get("hidden_act", "silu") != "silu":
        raise QuasarError(f"unsupported activation {config.get('hidden_act')!r} in {arch}: only silu-gated MLPs are supported")
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    theta, scaling = _rope(config)
    window = config.get("sliding_window") if config.get("use_sliding_window", True) else None
    return DecoderSpec(
        architecture=arch,
        vocab_size=int(config["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(config["intermediate_size"]),
        num_layers=int(config["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(config.get("head_dim") or hidden // heads),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)) and "lm_head.weight" not in tensor_names,
        qk_norm="model.layers.0.self_attn.q_norm.weight" in tensor_names,
        sliding_window=int(window) if window else None,
    )


def rope_inv_freq(spec: DecoderSpec):
    """Inverse frequencies as Hugging Face computes them (default, linear and llama3 rules)."""
    import torch

    dim = spec.head_dim
    inv = 1.0 / (spec.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = spec.rope_scaling
    if scaling is None:
        return inv
    kind = scaling.get("rope_type", scaling.get("type"))
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv / factor
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)
