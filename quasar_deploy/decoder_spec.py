"""Per-architecture facts: the decoder's shape and which norm or linear feeds which linears.

Llama-like checkpoints share one tensor layout; optional parts (QK-norm, biases) are read from the tensors present."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .errors import QuasarError

KNOWN_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "PanguEmbeddedForCausalLM")
ATTENTION_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class SmoothGroup:
    """Linears sharing one input; ``source`` absorbs the smoothing scale (None: no exact fold, o_proj under GQA)."""

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
            names += [f"{p}.self_attn.{n}" for n in ATTENTION_LINEARS] + [f"{p}.mlp.{n}" for n in MLP_LINEARS]
        return names

    def smooth_groups(self) -> list[SmoothGroup]:
        groups = []
        for i in range(self.num_layers):
            p = self.layer_prefix(i)
            attn, mlp = f"{p}.self_attn", f"{p}.mlp"
            qkv = tuple(f"{attn}.{n}" for n in ("q_proj", "k_proj", "v_proj"))
            groups.append(SmoothGroup(f"{p}.qkv", f"{p}.input_layernorm", "norm", qkv))
            o_source = (f"{attn}.v_proj", "linear") if self.num_kv_heads == self.num_heads else (None, "none")
            groups.append(SmoothGroup(f"{p}.o", *o_source, (f"{attn}.o_proj",)))
            groups.append(SmoothGroup(f"{p}.gate_up", f"{p}.post_attention_layernorm", "norm", (f"{mlp}.gate_proj", f"{mlp}.up_proj")))
            groups.append(SmoothGroup(f"{p}.down", f"{mlp}.up_proj", "linear", (f"{mlp}.down_proj",)))
        return groups


def _rope(config: dict) -> tuple[float, dict | None]:
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or None
    if not isinstance(params, dict) or not isinstance(scaling, dict | None):
        raise QuasarError("config.json: rope_parameters and rope_scaling must be JSON objects")
    theta = _number({"rope_theta": config.get("rope_theta", params.get("rope_theta", 10000.0))}, "rope_theta", float)
    if scaling is None and params.get("rope_type", "default") != "default":
        scaling = params
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind not in ("default", "linear", "llama3"):
            raise QuasarError(f"unsupported rope scaling {kind!r} (supported: default, linear, llama3)")
        if kind == "default":
            scaling = None
    return theta, scaling


_REQUIRED = object()


def _number(config: dict, name: str, kind: type, default: object = _REQUIRED, minimum: float | None = None) -> int | float:
    """One numeric config field, type-checked: a wrong checkpoint fails here, naming the field, not deep inside a forward."""
    value = config.get(name)
    if value is None:
        if default is _REQUIRED:
            raise QuasarError(f"config.json: {name} is missing")
        return default
    numeric = isinstance(value, int | float) and not isinstance(value, bool)
    if not numeric or (kind is int and value != int(value)) or not math.isfinite(value):
        raise QuasarError(f"config.json: {name} must be {'an integer' if kind is int else 'a finite number'}, not {value!r}")
    if minimum is not None and value < minimum:
        raise QuasarError(f"config.json: {name} must be >= {minimum}, not {value!r}")
    return kind(value)


def decoder_spec(config: dict, tensor_names: set[str]) -> DecoderSpec:
    """Read a Hugging Face config; refuse, in one line, what the shared decoder cannot run."""
    if not isinstance(config, dict):
        raise QuasarError(f"config.json: expected a JSON object, not {type(config).__name__}")
    archs = config.get("architectures") or [config.get("model_type", "unknown")]
    arch = str(archs[0]) if isinstance(archs, list) and archs else str(archs)
    if "model.layers.0.self_attn.q_proj.weight" not in tensor_names or "model.embed_tokens.weight" not in tensor_names:
        raise QuasarError(
            f"unsupported architecture {arch!r}: quasar-deploy runs Llama-like decoders "
            f"({', '.join(KNOWN_ARCHITECTURES)}) whose weights follow the model.layers.N.self_attn.q_proj layout"
        )
    if config.get("hidden_act", "silu") != "silu":
        raise QuasarError(f"unsupported activation {config.get('hidden_act')!r} in {arch}: only silu-gated MLPs are supported")
    hidden = _number(config, "hidden_size", int, minimum=1)
    heads = _number(config, "num_attention_heads", int, minimum=1)
    kv_heads = _number(config, "num_key_value_heads", int, heads, minimum=1)
    if heads % kv_heads:
        raise QuasarError(f"config.json: num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})")
    head_dim = _number(config, "head_dim", int, hidden // heads, minimum=1)
    if head_dim % 2:
        raise QuasarError(f"config.json: head_dim must be even for rotary embeddings, not {head_dim}")
    theta, scaling = _rope(config)
    if not (math.isfinite(theta) and theta > 0):
        raise QuasarError(f"config.json: rope_theta must be a positive finite number, not {theta!r}")
    eps = _number(config, "rms_norm_eps", float, 1e-6, minimum=0.0)
    if eps <= 0:
        raise QuasarError(f"config.json: rms_norm_eps must be > 0, not {eps!r}")
    window = config.get("sliding_window") if config.get("use_sliding_window", True) else None
    return DecoderSpec(
        architecture=arch,
        vocab_size=_number(config, "vocab_size", int, minimum=1),
        hidden_size=hidden,
        intermediate_size=_number(config, "intermediate_size", int, minimum=1),
        num_layers=_number(config, "num_hidden_layers", int, minimum=1),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=eps,
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=_number(config, "max_position_embeddings", int, 2048, minimum=2),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)) and "lm_head.weight" not in tensor_names,
        qk_norm="model.layers.0.self_attn.q_norm.weight" in tensor_names,
        sliding_window=_number(config, "sliding_window", int, minimum=1) if window else None,
    )


def expected_shapes(spec: DecoderSpec) -> dict[str, tuple[int, ...]]:
    """The shape of every float tensor a checkpoint of ``spec`` holds (quantized linears keep their float weight's shape)."""
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    linear = {"q_proj": (q, spec.hidden_size), "k_proj": (kv, spec.hidden_size), "v_proj": (kv, spec.hidden_size)}
    linear |= {"o_proj": (spec.hidden_size, q), "gate_proj": (spec.intermediate_size, spec.hidden_size)}
    linear |= {"up_proj": (spec.intermediate_size, spec.hidden_size), "down_proj": (spec.hidden_size, spec.intermediate_size)}
    shapes = {"model.embed_tokens.weight": (spec.vocab_size, spec.hidden_size), "model.norm.weight": (spec.hidden_size,)}
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, spec.hidden_size)
        shapes["lm_head.weight_scale"] = (spec.vocab_size, 1)
        shapes["lm_head.input_scale"] = (1,)
    for i in range(spec.num_layers):
        p = spec.layer_prefix(i)
        shapes[f"{p}.input_layernorm.weight"] = shapes[f"{p}.post_attention_layernorm.weight"] = (spec.hidden_size,)
        if spec.qk_norm:
            shapes[f"{p}.self_attn.q_norm.weight"] = shapes[f"{p}.self_attn.k_norm.weight"] = (spec.head_dim,)
        for name, shape in linear.items():
            block = "self_attn" if name in ATTENTION_LINEARS else "mlp"
            shapes[f"{p}.{block}.{name}.weight"] = shape
            shapes[f"{p}.{block}.{name}.bias"] = shape[:1]
            shapes[f"{p}.{block}.{name}.weight_scale"] = (shape[0], 1)
            shapes[f"{p}.{block}.{name}.input_scale"] = (1,)
    return shapes


def check_tensor_shapes(spec: DecoderSpec, shapes: dict[str, tuple[int, ...]]) -> None:
    """Every tensor agrees with config.json, and config.json names every layer the weights hold (else garbage loads)."""
    layers = {int(name.split(".")[2]) for name in shapes if name.startswith("model.layers.") and name.split(".")[2].isdigit()}
    if layers and max(layers) + 1 != spec.num_layers:
        raise QuasarError(f"config.json: num_hidden_layers is {spec.num_layers} but the weights hold {max(layers) + 1} layers")
    expected = expected_shapes(spec)
    for name, shape in sorted(shapes.items()):
        want = expected.get(name)
        if want is None:
            continue
        if name.endswith(".input_scale"):
            ok = len(shape) <= 1 and (not shape or shape[0] == 1)
        elif name.endswith(".weight_scale"):
            ok = tuple(shape) in (want, want[:1])
        else:
            ok = tuple(shape) == want
        if not ok:
            field = "vocab_size" if name in ("model.embed_tokens.weight", "lm_head.weight") else "its shape fields"
            raise QuasarError(f"{name} has shape {list(shape)}, but config.json ({field}) implies {list(want)}")


def rope_inv_freq(spec: DecoderSpec):
    """Inverse frequencies as Hugging Face computes them (default, linear and llama3 rules)."""
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
