"""One decoder for every Llama-like architecture, with a truncatable KV cache.

Our own rather than ``transformers``': a cache that rolls back in O(1), skippable layers for self-speculation, and
pluggable linear kernels. Parameter names are Hugging Face's; tests check the logits against ``transformers``.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from .cpu.linears import dtype_name, float_linear, half_linear, half_weights, int8_linear, packs_weight
from .decoder_spec import DecoderSpec, rope_inv_freq
from .errors import QuasarError
from .memory import EMBEDDINGS, return_freed_memory
from .shards import TORCH_DTYPES


class TensorSource(Protocol):
    """Where weights come from: a checkpoint, an artifact, or a dict in tests."""

    names: set[str]

    def tensor(self, name: str) -> torch.Tensor: ...


class BlockSource(TensorSource, Protocol):
    """A ``TensorSource`` that also hands out a 2-D tensor as row blocks (a checkpoint, or bench's random tensors)."""

    def row_blocks(self, name: str) -> Iterator[torch.Tensor]: ...


LinearFn = Callable[[torch.Tensor], torch.Tensor]
# (weight, weight_scale or None for a float layer, bias, input_scale) -> the layer's function: how a backend supplies kernels
KernelFactory = Callable[[torch.Tensor, "torch.Tensor | None", "torch.Tensor | None", "torch.Tensor | None"], LinearFn]


# (layer, qkv [rows, (heads + 2 kv heads) * head_dim]) -> attention output [rows, heads * head_dim]; the kernel norms,
# rotates and caches the keys and values itself
StepAttention = Callable[[int, torch.Tensor], torch.Tensor]


class AttentionKernel(Protocol):
    """A backend's own attention in place of ``Attention``'s torch ops (the cpu backend's C kernel, ``Decoder.attention_kernel``):
    the caches it reads (with ``KVCache``'s ``length``, ``reserve`` and ``truncate``) and, per pass, a ``StepAttention``."""

    itemsize: int  # bytes of a cached key or value

    def new_cache(self, capacity: int): ...

    def step(self, caches: list, sizes: list[int], cos: torch.Tensor, sin: torch.Tensor) -> StepAttention: ...


class RowKernel(Protocol):
    """A backend's own norms and SiLU gates (``Decoder.row_kernel``), in the input's dtype, each row's result its own."""

    def rms_norm(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor: ...

    def silu_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of ``gate_up`` [rows, 2 * inner] (gate's columns first)."""
        ...


def cpu_kernels(float_kernel: str = "torch", int8_kernel: str = "reference") -> KernelFactory:
    """The ``KernelFactory`` of ``cpu/linears.py``'s named kernels (the cpu backend, calibration, tests)."""

    def make(weight, weight_scale, bias, input_scale) -> LinearFn:
        if weight.dtype == torch.int8:
            return int8_linear(weight, weight_scale, bias, input_scale, int8_kernel)
        return float_linear(weight, bias, float_kernel)

    return make


HEAD = "lm_head"
PACK_BLOCK_BYTES = 1 << 28  # a narrow float weight is widened and packed this many float32 bytes of rows at a time


class Linear(nn.Module):
    """A linear layer in float or W8A8 form; ``prepare`` binds one of ``cpu/linears.py``'s kernels, ``bind`` any other.
    ``dtype``: what a float layer (and its input) computes in when its weight is stored in another dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        self.dtype = dtype or weight.dtype
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.register_buffer("weight_scale", None)
        self.register_buffer("input_scale", None)
        self._fn: LinearFn | None = None

    @property
    def quantized(self) -> bool:
        return self.weight.dtype == torch.int8

    @property
    def read_itemsize(self) -> int:
        """Bytes per weight value a call reads: int8's 1, else the compute dtype's or (``half_weights``) the stored one's."""
        if self.quantized or (self.weight.is_meta and self.weight.dtype != self.dtype):
            return self.weight.element_size()
        return self.dtype.itemsize

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    def set_quantized(self, wq: torch.Tensor, w_scale: torch.Tensor, input_scale: torch.Tensor | None) -> None:
        self.weight = nn.Parameter(wq, requires_grad=False)
        self.weight_scale = w_scale.float().reshape(-1, 1)
        self.input_scale = None if input_scale is None else input_scale.float().reshape(1)
        self._fn = None

    def prepare(self, float_kernel: str = "torch", int8_kernel: str = "reference") -> None:
        """Bind the kernel; one that packs its own copy gets the only copy (the weight left as meta: no re-prepare or save)."""
        if self.weight.is_meta:
            raise RuntimeError("this layer's weight was released to its packed kernel; load the model again to change kernels")
        kernels = cpu_kernels(float_kernel, int8_kernel)
        if self._converts and half_weights(self.weight.dtype, self.dtype, float_kernel):
            self._fn = half_linear(self.weight.data, None if self.bias is None else self.bias.data.float())
            self.release_weight(held=self.weight.dtype)
            return
        if self._converts and packs_weight(torch.empty(0, dtype=self.dtype, device=self.weight.device), float_kernel, int8_kernel):
            self._fn = self._packed_by_blocks(kernels)
            self.release_weight()
            return
        self._fn = kernels(*self.tensors())
        if packs_weight(self.weight, float_kernel, int8_kernel):
            self.release_weight()

    @property
    def _converts(self) -> bool:
        return not self.quantized and self.weight.dtype != self.dtype

    def _packed_by_blocks(self, kernels: KernelFactory) -> LinearFn:
        """One packed kernel per block of output rows, each converted as it is packed; their outputs side by side."""
        rows = max(1, PACK_BLOCK_BYTES // (self.in_features * self.dtype.itemsize))
        biases = self.bias.data.to(self.dtype).split(rows) if self.bias is not None else [None] * -(-self.out_features // rows)
        parts = []
        for block, bias in zip(self.weight.data.split(rows), biases):
            parts.append(kernels(block.to(self.dtype), None, bias, None))
            return_freed_memory()  # the widened block: glibc would keep it
        return parts[0] if len(parts) == 1 else lambda x: torch.cat([part(x) for part in parts], dim=-1)

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """What a ``KernelFactory`` takes: weight (a float one in ``dtype``), weight_scale, bias, input_scale."""
        weight = self.weight.data if self.quantized else self.weight.data.to(self.dtype)
        bias = None if self.bias is None else self.bias.data if self.quantized else self.bias.data.to(self.dtype)
        return weight, self.weight_scale, bias, self.input_scale

    def release_weight(self, held: torch.dtype | None = None) -> None:
        """Drop the weight's data once a kernel holds its own copy: a meta tensor in the dtype the kernel holds."""
        dtype = held or (self.weight.dtype if self.quantized else self.dtype)
        self.weight = nn.Parameter(torch.empty_like(self.weight, dtype=dtype, device="meta"), requires_grad=False)

    def bind(self, fn: LinearFn) -> None:
        """Run this layer with ``fn`` (2-D input to 2-D output): the hook for kernels that live with their backend (NPU)."""
        self._fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fn is None:
            self.prepare()
        shape = x.shape
        rows = x.reshape(-1, shape[-1])
        y = self._fn(rows if self.quantized else rows.to(self.dtype))  # a bf16 head in a float32 decoder computes in bf16
        return y.reshape(*shape[:-1], y.shape[-1]).to(x.dtype)


def held_text(head: Linear) -> str:
    """For descriptions: " (lm_head read as stored, bfloat16: quasar-half)" where a float head is so read; else empty."""
    if head.quantized or head.read_itemsize == head.dtype.itemsize:
        return ""
    return f" (lm_head read as stored, {dtype_name(head.weight.dtype)}: quasar-half)"


def fuse_linears(linears: list[Linear], kernels: KernelFactory) -> LinearFn | None:
    """One kernel call for linears that read the same input (q/k/v, gate/up), bit-exact with separate calls; None where they
    differ in kind or static input scale. The members' weights are released: only the fused kernel holds them."""
    first = linears[0]
    if any(lin.quantized != first.quantized or lin.weight.is_meta for lin in linears):
        return None
    if first.quantized and any(not _same(lin.input_scale, first.input_scale) for lin in linears):
        return None
    weight = torch.cat([lin.weight.data for lin in linears])
    bias_dtype = next((lin.bias.dtype for lin in linears if lin.bias is not None), None)
    bias = None
    if bias_dtype is not None:  # a member without a bias contributes zeros
        bias = torch.cat(
            [
                torch.zeros(lin.out_features, dtype=bias_dtype, device=weight.device) if lin.bias is None else lin.bias.data
                for lin in linears
            ]
        )
    scale = torch.cat([lin.weight_scale for lin in linears]) if first.quantized else None
    fn = kernels(weight, scale, bias, first.input_scale)
    for lin in linears:
        lin.release_weight()
        lin.bind(_released)
    return fn


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def _released(x: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("this linear runs fused with its siblings (Decoder.prepare(fuse=True)); call the fused projection")


def _split(fused: LinearFn, x: torch.Tensor, sizes: list[int]) -> tuple[torch.Tensor, ...]:
    shape = x.shape
    y = fused(x.reshape(-1, shape[-1])).to(x.dtype)
    return tuple(part.reshape(*shape[:-1], part.shape[-1]) for part in y.split(sizes, dim=-1))


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class KVCache:
    """Preallocated keys and values for one sequence; truncation only moves ``length``."""

    def __init__(self, spec: DecoderSpec, dtype: torch.dtype, device: torch.device | str, capacity: int = 256):
        self.spec, self.dtype, self.device = spec, dtype, device
        self.length = self.capacity = 0
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self._grow(capacity)

    def _grow(self, capacity: int) -> None:
        shape = (self.spec.num_kv_heads, capacity, self.spec.head_dim)
        new_k = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.spec.num_layers)]
        new_v = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.spec.num_layers)]
        for old, new in zip(self.keys + self.values, new_k + new_v):
            new[:, : self.capacity] = old
        self.keys, self.values, self.capacity = new_k, new_v, capacity

    def reserve(self, extra: int) -> None:
        """Room for ``extra`` more positions, and for the whole ``KEY_CHUNK`` they end in (cached attention reads it)."""
        end = round_up(self.length + extra, KEY_CHUNK)
        if end > self.capacity:
            self._grow(max(2 * self.capacity, end))

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.length + k.shape[1]
        self.keys[layer][:, self.length : end] = k
        self.values[layer][:, self.length : end] = v
        return self.keys[layer][:, :end], self.values[layer][:, :end]

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {length}")
        self.length = length


Loader = Callable[[str, bool], "torch.Tensor | None"]


CHECK_BLOCK_ELEMENTS = 1 << 24  # isfinite's temporaries for a bf16 tensor weigh 2.5x it: checked this much at a time


def check_finite(name: str, tensor: torch.Tensor) -> None:
    """Refuse at load NaN or infinite weights and scales not positive, a block of rows at a time (small temporaries)."""
    if tensor.dtype == torch.int8:
        return
    row = tensor.numel() // tensor.shape[0] if tensor.dim() and tensor.shape[0] else 1
    blocks = tensor.split(max(1, CHECK_BLOCK_ELEMENTS // max(1, row))) if tensor.dim() else [tensor]
    if not all(torch.isfinite(block).all() for block in blocks):
        raise QuasarError(f"tensor {name!r} holds NaN or infinite values (corrupted checkpoint)")
    if name.endswith("_scale") and not (tensor > 0).all():
        raise QuasarError(f"tensor {name!r} holds scales <= 0 (corrupted artifact)")


def tensor_loader(source: TensorSource, dtype: torch.dtype) -> Loader:
    """Reads ``source`` by name for the modules: checked finite, in ``dtype`` (int8 weights and scales keep theirs)."""

    def load(name: str, required: bool = True) -> torch.Tensor | None:
        if not required and name not in source.names:
            return None
        t = source.tensor(name)
        check_finite(name, t)
        return t if t.dtype == torch.int8 or name.endswith("_scale") else t.to(dtype)

    return load


def rotary(inv_freq: torch.Tensor, start: int, length: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of positions ``start .. start + length``: one definition for the decoder and for layer-by-layer calibration."""
    return rotary_at(inv_freq, torch.arange(start, start + length, device=inv_freq.device), dtype)


def rotary_at(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the positions held in a tensor (the cuda backend's CUDA graphs take positions as device data)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def visible(spec: DecoderSpec, positions: torch.Tensor, span: int) -> torch.Tensor:
    """[t, span] bool: which cached positions each query position attends to (causal, and the sliding window if any)."""
    keys = torch.arange(span, device=positions.device)[None, :]
    allowed = keys <= positions[:, None]
    if spec.sliding_window is not None:
        allowed &= keys > positions[:, None] - spec.sliding_window
    return allowed


# Attention after the prefill runs in fixed shapes, so that a row computes the same bits whatever block or batch it is in:
QUERY_ROWS = 8  # a block's query rows, in pieces of this many (the last piece padded)
KEY_CHUNK = 256  # keys are read up to a multiple of this, and values summed in chunks of exactly this many


@dataclass(frozen=True)
class Piece:
    """Up to ``QUERY_ROWS`` query rows of one block after the prefill: where they start and which cached keys each sees."""

    first: int  # the piece's first row within the block
    rows: int
    span: int  # cached positions read: the piece's end rounded up to KEY_CHUNK
    bias: torch.Tensor  # [group * QUERY_ROWS, span]: 0 where a row may look, -inf elsewhere (each query head of a kv group alike)


@dataclass(frozen=True)
class Segment:
    """One sequence's rows in a stacked forward: its cache, where the rows start, and what they attend to (built once
    per forward): ``prefill``, an empty cache's causal mask (None for one row), else ``pieces``."""

    cache: KVCache
    start: int
    rows: int
    prefill: torch.Tensor | None = None
    pieces: tuple[Piece, ...] = ()


def segment(spec: DecoderSpec, cache: KVCache, rows: int, device: torch.device | str) -> Segment:
    """The ``Segment`` of ``rows`` new positions appended to ``cache`` (its room reserved by the caller)."""
    start = cache.length
    if start == 0:
        return Segment(cache, start, rows, prefill=None if rows == 1 else visible(spec, torch.arange(rows, device=device), rows))
    pieces = []
    for first in range(0, rows, QUERY_ROWS):
        n = min(QUERY_ROWS, rows - first)
        span = round_up(start + first + n, KEY_CHUNK)
        positions = start + first + torch.arange(QUERY_ROWS, device=device).clamp(max=n - 1)  # padding rows: as the last row
        hidden = ~visible(spec, positions, span)
        bias = torch.zeros(QUERY_ROWS, span, dtype=cache.dtype, device=device).masked_fill_(hidden, float("-inf"))
        pieces.append(Piece(first, n, span, bias.repeat(spec.num_heads // spec.num_kv_heads, 1)))
    return Segment(cache, start, rows, pieces=tuple(pieces))


def load_linear(tensors: Loader, prefix: str) -> Linear:
    """Float (``weight`` [+ ``bias``]) or W8A8 (int8 ``weight``, ``weight_scale`` [, ``input_scale``])."""
    linear = Linear(tensors(f"{prefix}.weight", True), tensors(f"{prefix}.bias", False))
    if linear.quantized:
        linear.set_quantized(linear.weight.data, tensors(f"{prefix}.weight_scale", True), tensors(f"{prefix}.input_scale", False))
    return linear


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, spec: DecoderSpec, tensors: Loader, prefix: str):
        super().__init__()
        self.spec = spec
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(self, name, load_linear(tensors, f"{prefix}.{name}"))
        if spec.qk_norm:
            self.q_norm = RMSNorm(tensors(f"{prefix}.q_norm.weight"), spec.rms_norm_eps)
            self.k_norm = RMSNorm(tensors(f"{prefix}.k_norm.weight"), spec.rms_norm_eps)
        self.qkv: LinearFn | None = None

    def fuse(self, kernels: KernelFactory) -> None:
        self.qkv = fuse_linears([self.q_proj, self.k_proj, self.v_proj], kernels)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self.qkv is None:
            return self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return _split(self.qkv, x, [self.q_proj.out_features, self.k_proj.out_features, self.v_proj.out_features])

    def rotated_qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v of ``x`` [t, hidden] as [heads, t, head_dim], q and k normed and rotated (shared with the cuda backend)."""
        s = self.spec
        t = x.shape[0]
        q, k, v = self._project(x)
        q, k, v = q.view(t, s.num_heads, s.head_dim), k.view(t, s.num_kv_heads, s.head_dim), v.view(t, s.num_kv_heads, s.head_dim)
        if s.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = cos[:, None], sin[:, None]
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        return q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)

    def output(self, attended: torch.Tensor) -> torch.Tensor:
        """o_proj of the attention output [heads, t, head_dim]."""
        t = attended.shape[1]
        return self.o_proj(attended.transpose(0, 1).reshape(t, self.spec.num_heads * self.spec.head_dim))

    def forward(self, x, cos, sin, segments: Sequence[Segment], layer: int, step: StepAttention | None = None) -> torch.Tensor:
        if step is not None:  # a backend's kernel norms, rotates and attends every sequence's rows, over caches of its own
            qkv = self.qkv(x) if self.qkv is not None else torch.cat(self._project(x), dim=-1)
            return self.o_proj(step(layer, qkv).to(x.dtype))
        q, k, v = self.rotated_qkv(x, cos, sin)
        outs, row = [], 0
        for seg in segments:  # each sequence attends over its own cache only
            part = slice(row, row + seg.rows)
            outs.append(self._attend_cached(q[:, part], k[:, part], v[:, part], seg, layer))
            row += seg.rows
        return self.output(torch.cat(outs, dim=1) if len(outs) > 1 else outs[0])

    def _attend_cached(self, q, k, v, seg: Segment, layer: int) -> torch.Tensor:
        """One sequence's rows: write their keys and values to its cache, attend over what each row may see."""
        keys, values = seg.cache.write(layer, k, v)
        if seg.start == 0:
            return self.attend(q, keys, values, seg.prefill)
        keys, values = seg.cache.keys[layer], seg.cache.values[layer]
        parts = [self.attend_piece(q[:, p.first : p.first + p.rows], keys, values, p) for p in seg.pieces]
        return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]

    def attend_piece(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, piece: Piece) -> torch.Tensor:
        """Attention of up to ``QUERY_ROWS`` rows q [heads, n, d] over a cache's keys/values [kv heads, >= span, d], each row's
        bits the same in any block or batch: rows padded to QUERY_ROWS, scores over keys up to ``span`` (-inf where a row may
        not look), values summed in order in chunks of exactly KEY_CHUNK. Not promised by the GEMM: tests/test_attention.py."""
        s = self.spec
        group = s.num_heads // s.num_kv_heads
        queries = F.pad(q, (0, 0, 0, QUERY_ROWS - q.shape[1])).reshape(s.num_kv_heads, group * QUERY_ROWS, s.head_dim)
        scores = torch.baddbmm(piece.bias, queries, keys[:, : piece.span].transpose(1, 2), alpha=s.head_dim**-0.5)
        weights = scores.softmax(-1)
        out = torch.bmm(weights[:, :, :KEY_CHUNK], values[:, :KEY_CHUNK])
        for c in range(KEY_CHUNK, piece.span, KEY_CHUNK):
            out = out + torch.bmm(weights[:, :, c : c + KEY_CHUNK], values[:, c : c + KEY_CHUNK])
        return out.view(s.num_heads, QUERY_ROWS, s.head_dim)[:, : q.shape[1]]

    def attend(self, q, keys, values, mask: torch.Tensor | None) -> torch.Tensor:
        """Scaled dot-product attention of q [heads, t, d] over keys/values [kv heads, n, d] (grouped-query aware)."""
        gqa = self.spec.num_kv_heads != self.spec.num_heads
        return F.scaled_dot_product_attention(q.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0), attn_mask=mask, enable_gqa=gqa)[0]


class MLP(nn.Module):
    def __init__(self, tensors: Loader, prefix: str):
        super().__init__()
        for name in ("gate_proj", "up_proj", "down_proj"):
            setattr(self, name, load_linear(tensors, f"{prefix}.{name}"))
        self.gate_up: LinearFn | None = None

    def fuse(self, kernels: KernelFactory) -> None:
        self.gate_up = fuse_linears([self.gate_proj, self.up_proj], kernels)

    def forward(self, x: torch.Tensor, rows: RowKernel | None = None) -> torch.Tensor:
        if rows is not None and self.gate_up is not None:
            return self.down_proj(rows.silu_gate(self.gate_up(x)).to(x.dtype))
        if self.gate_up is None:
            gate, up = self.gate_proj(x), self.up_proj(x)
        else:
            gate, up = _split(self.gate_up, x, [self.gate_proj.out_features, self.up_proj.out_features])
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, spec: DecoderSpec, tensors, prefix: str):
        super().__init__()
        self.input_layernorm = RMSNorm(tensors(f"{prefix}.input_layernorm.weight"), spec.rms_norm_eps)
        self.self_attn = Attention(spec, tensors, f"{prefix}.self_attn")
        self.post_attention_layernorm = RMSNorm(tensors(f"{prefix}.post_attention_layernorm.weight"), spec.rms_norm_eps)
        self.mlp = MLP(tensors, f"{prefix}.mlp")

    def fuse(self, kernels: KernelFactory) -> None:
        """q/k/v and gate/up as one ``kernels`` call each (where their kinds and input scales allow)."""
        self.self_attn.fuse(kernels)
        self.mlp.fuse(kernels)

    def forward(
        self, x, cos, sin, segments: Sequence[Segment], layer: int, step: StepAttention | None = None, rows: RowKernel | None = None
    ) -> torch.Tensor:
        if rows is None:
            x = x + self.self_attn(self.input_layernorm(x), cos, sin, segments, layer, step)
            return x + self.mlp(self.post_attention_layernorm(x))
        x = x + self.self_attn(rows.rms_norm(x, self.input_layernorm), cos, sin, segments, layer, step)
        return x + self.mlp(rows.rms_norm(x, self.post_attention_layernorm), rows)


class Body(nn.Module):
    """Holds ``embed_tokens``, ``layers`` and ``norm`` under Hugging Face's ``model.`` prefix."""

    def __init__(self, spec: DecoderSpec, tensors, embeddings: torch.Tensor):
        super().__init__()
        self.embed_tokens = nn.Embedding.from_pretrained(embeddings, freeze=True)
        self.layers = nn.ModuleList()
        for i in range(spec.num_layers):
            self.layers.append(DecoderLayer(spec, tensors, spec.layer_prefix(i)))
            return_freed_memory()  # what converting or quantizing its tensors freed (a few MB each): glibc would keep it
        self.norm = RMSNorm(tensors("model.norm.weight"), spec.rms_norm_eps)


def as_stored(source: TensorSource, name: str, dtype: torch.dtype) -> torch.Tensor:
    """``name`` in its stored float dtype where that is no wider than ``dtype`` (else converted to ``dtype``), checked
    finite: the embedding table's lookups convert the few rows they read, a head is widened only as its kernel packs it."""
    tensor = source.tensor(name)
    check_finite(name, tensor)
    return tensor if kept_as_stored(tensor.dtype, dtype) else tensor.to(dtype)


def kept_as_stored(stored: torch.dtype, dtype: torch.dtype) -> bool:
    """Whether a tensor stored as ``stored`` is kept so by a decoder computing in ``dtype`` (a float no wider)."""
    return stored.is_floating_point and stored.itemsize <= dtype.itemsize


def embedding_table(source: TensorSource, dtype: torch.dtype) -> tuple[torch.Tensor, mmap.mmap | None]:
    """The embedding table as ``as_stored`` gives it, read in place from its file where the source can map it and it is kept
    as stored, with the map (``Decoder.release_table_pages``); else None."""
    stored = getattr(source, "dtypes", {}).get(EMBEDDINGS)
    mapped = getattr(source, "mapped", None)
    found = mapped(EMBEDDINGS) if mapped is not None and stored is not None and kept_as_stored(TORCH_DTYPES[stored], dtype) else None
    if found is None:
        return as_stored(source, EMBEDDINGS, dtype), None
    table, pages = found
    check_finite(EMBEDDINGS, table)
    return table, pages


class Decoder(nn.Module):
    """Causal decoder: ``forward(ids, cache)`` appends ``ids`` to the cache and returns their logits (``forward_blocks``: several)."""

    def __init__(
        self,
        spec: DecoderSpec,
        source: TensorSource,
        dtype: torch.dtype = torch.float32,
        lm_head: Linear | None = None,
        head_dtype: torch.dtype | None = None,
    ):
        """``dtype``: what activations, norms, attention and float layers compute in; ``head_dtype``: a float lm_head's (default
        ``dtype``). ``lm_head``: the head of a twin over the same weights, shared so that it is packed once."""
        super().__init__()
        self.spec = spec
        self.dtype = dtype
        head_dtype = head_dtype or dtype

        load = tensor_loader(source, dtype)
        table, self._table_pages = embedding_table(source, dtype)
        self.model = Body(spec, load, table)
        if lm_head is None and spec.tie_word_embeddings:
            lm_head = Linear(self.model.embed_tokens.weight, dtype=head_dtype)
        elif lm_head is None and f"{HEAD}.weight_scale" in source.names:
            lm_head = load_linear(load, HEAD)  # ``--int8-lm-head``: a W8A8 linear like the others, so every backend runs it
        elif lm_head is None:
            lm_head = Linear(as_stored(source, f"{HEAD}.weight", dtype), load(f"{HEAD}.bias", False), head_dtype)
        self.lm_head = lm_head
        self.register_buffer("inv_freq", rope_inv_freq(spec), persistent=False)
        self.attention_kernel: AttentionKernel | None = None  # a backend's own attention, set before any cache is made
        self.row_kernel: RowKernel | None = None  # a backend's own norms and SiLU gates
        self.release_table_pages()

    def linears(self) -> Iterable[tuple[str, Linear]]:
        return ((n, m) for n, m in self.named_modules() if isinstance(m, Linear) and n != "lm_head")

    def prepare(self, float_kernel: str = "torch", int8_kernel: str = "reference", fuse: bool = False) -> None:
        """Bind kernels to every linear (a kernel holding its only copy kept), a layer at a time with ``return_freed_memory``;
        ``fuse`` runs q/k/v and gate/up as one call each (calibration keeps them apart: it hooks each linear)."""
        kernels = cpu_kernels(float_kernel, int8_kernel)
        for part in [*self.model.layers, self.lm_head]:
            if fuse and isinstance(part, DecoderLayer):
                part.fuse(kernels)
            for module in part.modules():
                if isinstance(module, Linear) and module._fn is not _released and not (module._fn is not None and module.weight.is_meta):
                    module.prepare(float_kernel, int8_kernel)
            return_freed_memory()
        self.release_table_pages()  # a tied head packed from the table read all of it

    def release_table_pages(self) -> None:
        """Hand back the pages of a table read in place (``embedding_table``) that loading touched whole."""
        if self._table_pages is not None:
            self._table_pages.madvise(mmap.MADV_DONTNEED)

    def fuse(self, kernels: KernelFactory) -> None:
        """q/k/v and gate/up of every layer as one ``kernels`` call each (``DecoderLayer.fuse``)."""
        for layer in self.model.layers:
            layer.fuse(kernels)

    def move_to(self, device: torch.device | str) -> None:
        """Move every tensor to ``device`` except meta placeholders (weights a bound kernel already holds on the device)."""
        self._apply(lambda t: t if t.is_meta else t.to(device))

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows of ``ids`` in the compute dtype (the table may be stored narrower, see ``as_stored``)."""
        return self.model.embed_tokens(ids).to(self.dtype)

    def new_cache(self, capacity: int = 256) -> KVCache:
        if self.attention_kernel is not None:
            return self.attention_kernel.new_cache(capacity)
        return KVCache(self.spec, self.dtype, self.inv_freq.device, capacity)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, cache: KVCache, skip_layers: frozenset[int] = frozenset()) -> torch.Tensor:
        return self.forward_blocks([ids], [cache], skip_layers)

    @torch.inference_mode()
    def forward_blocks(
        self,
        blocks: Sequence[torch.Tensor],
        caches: Sequence[KVCache],
        skip_layers: frozenset[int] = frozenset(),
        last_only: Sequence[bool] = (),
    ) -> torch.Tensor:
        """Appends ``blocks[i]`` to ``caches[i]`` for every i in one pass (rotary and attention per sequence); their logits
        [rows, vocab]: every row's, or only the last one of a block whose ``last_only[i]`` is true."""
        sizes = [block.shape[0] for block in blocks]
        for cache, t in zip(caches, sizes):
            cache.reserve(t)
        device = blocks[0].device
        starts = [cache.length for cache in caches]
        kernel, row_kernel = self.attention_kernel, self.row_kernel
        # a kernel rotates in float32 whatever the decoder computes in
        ropes = [rotary(self.inv_freq, start, t, self.dtype if kernel is None else torch.float32) for start, t in zip(starts, sizes)]
        cos, sin = (torch.cat(parts) for parts in zip(*ropes)) if len(ropes) > 1 else ropes[0]
        step = kernel.step(list(caches), sizes, cos, sin) if kernel is not None else None
        segments = [segment(self.spec, cache, t, device) for cache, t in zip(caches, sizes)] if step is None else []
        x = self.embed(torch.cat(list(blocks)) if len(blocks) > 1 else blocks[0])
        for i, layer in enumerate(self.model.layers):
            if i not in skip_layers:
                x = layer(x, cos, sin, segments, i, step, row_kernel)
        for cache, start, t in zip(caches, starts, sizes):
            cache.length = start + t
        if any(last_only):
            ends = [sum(sizes[: i + 1]) for i in range(len(sizes))]
            rows = [r for end, t, last in zip(ends, sizes, last_only) for r in ([end - 1] if last else range(end - t, end))]
            x = x[torch.tensor(rows, device=device)]
        return self.lm_head(self.model.norm(x) if row_kernel is None else row_kernel.rms_norm(x, self.model.norm)).float()
