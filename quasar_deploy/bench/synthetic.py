"""Random-weight decoders of published shapes, for timing only (their outputs mean nothing).

Weights stream from memory at these sizes, where int8 pays (the demo model sits in cache); reports say "synthetic weights"."""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Iterator, Mapping

import torch

from ..backends.torch_backend import bind_cpu_attention
from ..cpu.linears import half_weights
from ..decoder_spec import DecoderSpec, expected_shapes
from ..errors import QuasarError
from ..model import Decoder
from ..scheme import quantize_weight
from ..shapes import SHAPES

HEAD_WEIGHT = "lm_head.weight"
STORED_DTYPE = torch.bfloat16


def synthetic_spec(name: str) -> DecoderSpec:
    if name not in SHAPES:
        raise QuasarError(f"unknown synthetic shape {name!r}; choose from {', '.join(SHAPES)}")
    hidden, inner, layers, heads, kv, head_dim, vocab, tied = SHAPES[name]
    return DecoderSpec(
        architecture=f"synthetic {name}",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inner,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=head_dim,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        rope_scaling=None,
        max_position_embeddings=4096,
        tie_word_embeddings=tied,
        qk_norm=name.startswith("qwen3"),
        sliding_window=None,
    )


def is_layer_linear(name: str) -> bool:
    """Whether ``name`` is a decoder layer's linear weight (quantized in W8A8; embeddings, norms and lm_head stay float)."""
    return name.startswith("model.layers.") and name.endswith("_proj.weight")


class RandomTensors:
    """A ``TensorSource`` inventing each tensor on request (normal(0, 0.02), unit norms; bf16 as published), each from its
    own generator seeded by ``seed`` and its name, so that any subset in any order holds the same values; ``quantized``:
    layer linears (and an ``int8_lm_head``) as int8 with their scales; ``shared`` tensors handed out as they are."""

    def __init__(
        self,
        spec: DecoderSpec,
        seed: int = 0,
        device: torch.device | str = "cpu",
        quantized: bool = False,
        shared: Mapping[str, torch.Tensor] | None = None,
        int8_lm_head: bool = False,
    ):
        self.spec = spec
        self.seed = seed
        self.device = device
        self.quantized = quantized
        self.shared = dict(shared or {})
        self.shapes = {name: shape for name, shape in expected_shapes(spec).items() if name.endswith(".weight")}
        self.head_from = "model.embed_tokens.weight" if spec.tie_word_embeddings else HEAD_WEIGHT
        self.int8 = {name for name in self.shapes if is_layer_linear(name)} | ({HEAD_WEIGHT} if int8_lm_head else set())
        if int8_lm_head:
            self.shapes[HEAD_WEIGHT] = self.shapes[self.head_from]
        scales = {name.removesuffix(".weight") + ".weight_scale" for name in self.int8}
        self.names = set(self.shapes) | (scales if quantized else set())
        self._scales: dict[str, torch.Tensor] = {}

    def _draw(self, name: str) -> torch.Tensor:
        shape = self.shapes[name]
        if len(shape) == 1:
            return torch.ones(shape, dtype=STORED_DTYPE, device=self.device)
        digest = hashlib.sha256(f"{self.seed}:{self.head_from if name == HEAD_WEIGHT else name}".encode()).digest()
        generator = torch.Generator(device=self.device).manual_seed(int.from_bytes(digest[:8], "little"))
        return torch.randn(shape, generator=generator, device=self.device).mul_(0.02).to(STORED_DTYPE)

    def tensor(self, name: str) -> torch.Tensor:
        if name in self.shared:
            return self.shared[name]
        if name.endswith(".weight_scale"):  # asked for right after its weight (model.load_linear)
            return self._scales.pop(name)
        if self.quantized and name in self.int8:
            weight, self._scales[name.removesuffix(".weight") + ".weight_scale"] = quantize_weight(self._draw(name))
            return weight
        return self._draw(name)

    def row_blocks(self, name: str) -> Iterator[torch.Tensor]:
        """The tensor as one block (a draw cannot be split into rows and stay the same draw); for ``source_graph``."""
        yield self.tensor(name)


def synthetic_decoders(
    name: str,
    seed: int = 0,
    kernels: tuple[str, str] | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    int8_lm_head: bool = False,
) -> tuple[Decoder, Decoder]:
    """(float, W8A8) decoders with identical random weights (W8A8 unsmoothed, activations float32 on a CPU), built lean: the
    W8A8 one shares the float one's embedding, norms and packed head (unless ``int8_lm_head``: its own, untied) and is
    quantized tensor by tensor; ``kernels`` (float, int8) prepares both, the float one first."""
    spec = synthetic_spec(name)
    float_model = Decoder(spec, RandomTensors(spec, seed, device), dtype)
    on_cpu = torch.device(device).type == "cpu"
    if kernels:
        float_model.prepare(*kernels, fuse=True)
        if on_cpu:
            bind_cpu_attention(float_model)
    own = {HEAD_WEIGHT} if int8_lm_head else set()
    shared = {n: t for n, t in float_model.state_dict().items() if not t.is_meta and not is_layer_linear(n) and n not in own}
    quant_spec = dataclasses.replace(spec, tie_word_embeddings=False) if int8_lm_head else spec
    source = RandomTensors(spec, seed, device, quantized=True, shared=shared, int8_lm_head=int8_lm_head)
    activations = torch.float32 if on_cpu else dtype
    quant_model = Decoder(quant_spec, source, activations, lm_head=None if int8_lm_head else float_model.lm_head, head_dtype=dtype)
    if kernels:
        quant_model.prepare(*kernels, fuse=True)
        if on_cpu:
            bind_cpu_attention(quant_model)
    return float_model, quant_model


LIBRARIES_BYTES = 10**9  # the libraries (torch, transformers), kernel scratch, allocator slack


def _linear_bytes(spec: DecoderSpec) -> tuple[int, int]:
    """The layers' linears: float32 bytes, and int8 bytes with their float32 per-channel scales."""
    shapes = expected_shapes(spec)
    elements = sum(math.prod(shape) for name, shape in shapes.items() if is_layer_linear(name))
    scales = sum(shapes[n.removesuffix(".weight") + ".weight_scale"][0] for n in shapes if is_layer_linear(n))
    return 4 * elements, elements + 4 * scales


def step_read_bytes(spec: DecoderSpec, quantized: bool, int8_lm_head: bool = False, float_itemsize: int = 4) -> int:
    """Bytes of weights one step of the float (or the W8A8) twin reads, as ``micro.weight_bytes`` counts, from the shape."""
    float_linears, int8_linears = _linear_bytes(spec)
    head = spec.vocab_size * spec.hidden_size * head_read_itemsize(float_itemsize)
    if not quantized:
        return float_linears * float_itemsize // 4 + head
    return int8_linears + (spec.vocab_size * (spec.hidden_size + 4) if int8_lm_head else head)


def head_read_itemsize(float_itemsize: int) -> int:
    """Bytes per value a synthetic twin's float head reads: as drawn where ``half_weights`` sends it to ``quasar-half``."""
    dtype = torch.float32 if float_itemsize == 4 else torch.bfloat16
    return STORED_DTYPE.itemsize if half_weights(STORED_DTYPE, dtype, "onednn") else float_itemsize


def engines_peak_bytes(spec: DecoderSpec, int8_lm_head: bool = False, float_itemsize: int = 4) -> int:
    """Peak resident bytes of ``synthetic_decoders(kernels=...)`` plus the libraries (an int8 head is drawn, then quantized
    through three float32 copies at once, ``scheme.quantize_weight``)."""
    float_linears, int8_linears = _linear_bytes(spec)
    table = spec.vocab_size * spec.hidden_size
    stored = STORED_DTYPE.itemsize
    engines = float_linears * float_itemsize // 4 + (float_itemsize + stored) * table + int8_linears
    if int8_lm_head:
        engines += (stored + 3 * 4) * table
    return engines + LIBRARIES_BYTES


def engine_alone_bytes(spec: DecoderSpec, quantized: bool, int8_lm_head: bool = False, float_itemsize: int = 4) -> int:
    """Peak resident bytes of one synthetic engine built alone (the W8A8 one with its own head), plus the libraries."""
    int8_linears = _linear_bytes(spec)[1]
    table = spec.vocab_size * spec.hidden_size
    stored = STORED_DTYPE.itemsize
    if not quantized:
        return engines_peak_bytes(spec, float_itemsize=float_itemsize) - int8_linears
    return int8_linears + stored * table + ((stored + 3 * 4) * table if int8_lm_head else float_itemsize * table) + LIBRARIES_BYTES


def w8a8_source(name: str, seed: int = 0, int8_lm_head: bool = False) -> tuple[DecoderSpec, RandomTensors]:
    """The W8A8 twin's spec (untied when it has its own int8 head) and its tensors, quantized one at a time as asked for."""
    spec = synthetic_spec(name)
    quant_spec = dataclasses.replace(spec, tie_word_embeddings=False) if int8_lm_head else spec
    return quant_spec, RandomTensors(spec, seed, quantized=True, int8_lm_head=int8_lm_head)


def synthetic_w8a8_decoder(name: str, seed: int = 0, int8_lm_head: bool = False) -> Decoder:
    """The W8A8 decoder of ``synthetic_decoders`` alone, quantized tensor by tensor (no float copy held meanwhile)."""
    return Decoder(*w8a8_source(name, seed, int8_lm_head))
