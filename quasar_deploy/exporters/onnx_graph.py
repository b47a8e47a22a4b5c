"""The ONNX decoder graph: one graph for prefill, k+1-token verify and single-token decode.

Optimum / onnxruntime-genai input and output names, with dynamic batch, sequence and past axes. W8A8 linears take one of
``LINEAR_FORMATS`` (docs/onnx.md): ``integer`` (bit-exact to ``scheme.py``: the activation quantized in the graph,
shifted to uint8 with zero point 128, times the int8 weight in ``MatMulInteger``, scaled in the reference's order; ORT
fuses no run-time per-row scale into ``DequantizeLinear``) or ``qdq`` (static artifacts: Q/DQ pairs around a float
``MatMul``, which TensorRT fuses; a ``Clip`` first, as the scheme saturates at -127, ``QuantizeLinear`` at -128)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from ..decoder_spec import DecoderSpec
from ..model import MLP, Attention, DecoderLayer, Linear, RMSNorm
from ..scheme import QMAX
from . import ONNX_HIDDEN_OUTPUT
from .onnx_versions import OPSETS, make_model

ZERO_POINT = 128
MASKED = float(np.finfo(np.float32).min)
BATCH, SEQUENCE, PAST, TOTAL = "batch_size", "sequence_length", "past_sequence_length", "total_sequence_length"


def past_names(layer: int) -> tuple[str, str]:
    return f"past_key_values.{layer}.key", f"past_key_values.{layer}.value"


def present_names(layer: int) -> tuple[str, str]:
    return f"present.{layer}.key", f"present.{layer}.value"


class ExternalData:
    """The weights file of an exported graph, filled as initializers are made, so its weights are never in memory whole."""

    ALIGN = 4096  # page-aligned offsets let ONNX Runtime map the file instead of copying it

    def __init__(self, path: Path, min_bytes: int = 1024):
        self.path, self.min_bytes = Path(path), min_bytes
        self._file = open(self.path, "wb+")
        self._end = 0

    def _place(self, name: str, dtype: np.dtype, shape: Sequence[int]) -> tuple[onnx.TensorProto, int]:
        start = -(-self._end // self.ALIGN) * self.ALIGN
        length = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        self._end = start + length
        self._file.truncate(self._end)
        proto = onnx.TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(np.dtype(dtype)), dims=list(shape))
        proto.data_location = onnx.TensorProto.EXTERNAL
        for key, value in (("location", self.path.name), ("offset", str(start)), ("length", str(length))):
            proto.external_data.add(key=key, value=value)
        return proto, start

    def write(self, name: str, array: np.ndarray) -> onnx.TensorProto:
        proto, start = self._place(name, array.dtype, array.shape)
        self._file.seek(start)
        self._file.write(np.ascontiguousarray(array).data)
        return proto

    def fill(self, name: str, dtype: np.dtype, shape: Sequence[int], fill: Callable[[np.ndarray], None]) -> onnx.TensorProto:
        """A tensor written in place through a file-backed view, e.g. block by block from a checkpoint."""
        proto, start = self._place(name, dtype, shape)
        self._file.flush()
        view = np.memmap(self._file, dtype=dtype, mode="r+", offset=start, shape=tuple(shape))
        fill(view)
        view.flush()
        del view
        return proto

    def close(self) -> None:
        self._file.close()


class GraphBuilder:
    """Nodes and initializers with generated names; big initializers go to ``external`` as they are made."""

    def __init__(self, linear_format: str = "integer", external: ExternalData | None = None) -> None:
        self.linear_format = linear_format
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.external = external
        self._count = 0
        self._scalars: dict[tuple[str, float], str] = {}
        self._row_zero_point: str | None = None

    @property
    def opset(self) -> int:
        return OPSETS[self.linear_format]

    def model(
        self, name: str, inputs: list[onnx.ValueInfoProto], outputs: list[onnx.ValueInfoProto], domains: Iterable[tuple[str, int]] = ()
    ) -> onnx.ModelProto:
        """The graph so far as a model declaring this form's opset, its IR version (``onnx_versions``) and ``domains``."""
        return make_model(helper.make_graph(self.nodes, name, inputs, outputs, self.initializers), self.opset, domains)

    def _name(self, hint: str) -> str:
        self._count += 1
        return f"{hint}_{self._count}"

    def const(self, array: np.ndarray, name: str | None = None) -> str:
        name = name or self._name("const")
        if self.external is not None and array.nbytes >= self.external.min_bytes:
            self.initializers.append(self.external.write(name, array))
        else:
            self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def const_filled(self, name: str, dtype: np.dtype, shape: Sequence[int], fill: Callable[[np.ndarray], None]) -> str:
        """A large initializer filled in place (external file) or in memory (no external file)."""
        if self.external is not None:
            self.initializers.append(self.external.fill(name, dtype, shape, fill))
        else:
            array = np.empty(shape, dtype)
            fill(array)
            self.initializers.append(numpy_helper.from_array(array, name))
        return name

    def rank0(self, value: float, dtype, name: str) -> str:
        """A named 0-d initializer: per-tensor Q/DQ needs scalars (a one-element 1-D scale means per-axis)."""
        self.initializers.append(numpy_helper.from_array(np.array(value, dtype=dtype), name))
        return name

    def scalar(self, value: float, dtype=np.float32) -> str:
        """Shared small constants (one initializer per value and type)."""
        key = (np.dtype(dtype).name, float(value))
        if key not in self._scalars:
            self._scalars[key] = self.const(np.array(value, dtype=dtype))
        return self._scalars[key]

    def ints(self, values: list[int]) -> str:
        return self.const(np.array(values, dtype=np.int64))

    def op(self, op_type: str, *inputs: str, outputs: int | list[str] = 1, **attrs) -> str:
        names = outputs if isinstance(outputs, list) else [self._name(op_type) for _ in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), names, **attrs))
        return names[0] if len(names) == 1 else names

    def row_zero_point(self, x: str) -> str:
        """uint8 128 shaped [..., 1] like ``x``'s per-row scales, as a blocked ``QuantizeLinear`` wants; made once."""
        if self._row_zero_point is None:
            rows = self.op("Slice", self.op("Shape", x), self.ints([0]), self.ints([-1]))
            shape = self.op("Concat", rows, self.ints([1]), axis=0)
            self._row_zero_point = self.op("Expand", self.scalar(ZERO_POINT, np.uint8), shape)
        return self._row_zero_point


def activation_codes(g: GraphBuilder, x: str, depth: int, input_scale: float | None) -> tuple[str, str]:
    """``scheme``'s int8 codes of ``x`` as uint8 with zero point 128, and their scale: per row, or the calibrated one."""
    if input_scale is None:
        row_max = g.op("ReduceMax", g.op("Abs", x), g.ints([-1]), keepdims=1)
        scale = g.op("Max", g.op("Div", row_max, g.scalar(QMAX)), g.scalar(1e-12))
        return g.op("QuantizeLinear", x, scale, g.row_zero_point(x), axis=-1, block_size=depth), scale
    scale = g.scalar(input_scale)
    clipped = g.op("Clip", x, g.scalar(-QMAX * input_scale), g.scalar(QMAX * input_scale))
    return g.op("QuantizeLinear", clipped, scale, g.scalar(ZERO_POINT, np.uint8)), scale


def w8a8_linear(g: GraphBuilder, x: str, wq: np.ndarray, w_scale: np.ndarray, input_scale: float | None, prefix: str) -> str:
    """``scheme.reference_linear`` on the last axis of ``x``, bit for bit (integer-exact int32 accumulation)."""
    codes, scale = activation_codes(g, x, wq.shape[1], input_scale)
    weight = g.const(np.ascontiguousarray(wq.astype(np.int8).T), f"{prefix}.weight_int8")
    # explicit, one per linear: under session.x64quantprecision ORT 1.20-1.21 abort without it, 1.32 refuses a shared one
    zero_points = (g.scalar(ZERO_POINT, np.uint8), g.rank0(0, np.int8, f"{prefix}.weight_zero_point"))
    acc = g.op("Cast", g.op("MatMulInteger", codes, weight, *zero_points), to=TensorProto.FLOAT)
    return g.op("Mul", g.op("Mul", acc, scale), g.const(w_scale.reshape(-1).astype(np.float32), f"{prefix}.weight_scale"))


def qdq_linear(g: GraphBuilder, x: str, wq: np.ndarray, w_scale: np.ndarray, input_scale: float | None, prefix: str) -> str:
    """``scheme.reference_linear`` with a static scale, as Q/DQ pairs around a float ``MatMul`` (the form TensorRT fuses)."""
    if input_scale is None:
        raise ValueError("the QDQ form needs a constant (static) activation scale")
    # one scale per linear: shared ones let ORT merge q/k/v's Q/DQ into one node its QDQ fusion leaves as float MatMuls
    scale, zero = g.rank0(input_scale, np.float32, f"{prefix}.input_scale"), g.rank0(0, np.int8, f"{prefix}.input_zero_point")
    low = g.rank0(-QMAX * input_scale, np.float32, f"{prefix}.input_min")
    high = g.rank0(QMAX * input_scale, np.float32, f"{prefix}.input_max")
    clipped = g.op("Clip", x, low, high)  # the scheme saturates at -127, QuantizeLinear at -128
    activation = g.op("DequantizeLinear", g.op("QuantizeLinear", clipped, scale, zero), scale, zero)
    weight = g.const(np.ascontiguousarray(wq.astype(np.int8).T), f"{prefix}.weight_int8")  # [in, out]
    weight_scale = g.const(w_scale.reshape(-1).astype(np.float32), f"{prefix}.weight_scale")
    weight_zero = g.const(np.zeros(wq.shape[0], np.int8), f"{prefix}.weight_zero_point")
    return g.op("MatMul", activation, g.op("DequantizeLinear", weight, weight_scale, weight_zero, axis=1))


LINEAR_FORMATS = {"integer": w8a8_linear, "qdq": qdq_linear}


def linear(g: GraphBuilder, x: str, layer: Linear, prefix: str) -> str:
    if layer.quantized:
        input_scale = None if layer.input_scale is None else float(layer.input_scale.item())
        y = LINEAR_FORMATS[g.linear_format](g, x, layer.weight.numpy(), layer.weight_scale.numpy(), input_scale, prefix)
    else:
        y = g.op("MatMul", x, g.const(layer.weight.float().numpy().T, f"{prefix}.weight_t"))
    if layer.bias is not None:
        y = g.op("Add", y, g.const(layer.bias.float().numpy(), f"{prefix}.bias"))
    return y


def shared_input_linears(g: GraphBuilder, x: str, layers: Sequence[Linear], prefixes: Sequence[str], fused: str) -> list[str]:
    """Linears reading the same ``x`` as one product whose output is split, where that changes no number."""
    scales = {None if layer.input_scale is None else float(layer.input_scale.item()) for layer in layers}
    quantized = {layer.quantized for layer in layers}
    if quantized == {True} and g.linear_format == "integer" and len(scales) == 1:
        wq = np.concatenate([layer.weight.numpy() for layer in layers])
        w_scale = np.concatenate([layer.weight_scale.numpy().reshape(-1) for layer in layers])
        y = w8a8_linear(g, x, wq, w_scale, scales.pop(), fused)
    elif quantized == {False}:
        weight_t = np.concatenate([layer.weight.float().numpy() for layer in layers]).T
        y = g.op("MatMul", x, g.const(weight_t, f"{fused}.weight_t"))
    else:
        return [linear(g, x, layer, prefix) for layer, prefix in zip(layers, prefixes)]
    biases = [layer.bias for layer in layers]
    if any(bias is not None for bias in biases):
        full = [torch.zeros(layer.out_features) if bias is None else bias.float() for layer, bias in zip(layers, biases)]
        y = g.op("Add", y, g.const(torch.cat(full).numpy(), f"{fused}.bias"))
    return g.op("Split", y, g.ints([layer.out_features for layer in layers]), axis=-1, outputs=len(layers))


def rms_norm(g: GraphBuilder, x: str, norm: RMSNorm, name: str) -> str:
    """x / sqrt(mean(x^2) + eps) * w: the pattern ORT fuses into SimplifiedLayerNormalization."""
    mean = g.op("ReduceMean", g.op("Pow", x, g.scalar(2.0)), g.ints([-1]), keepdims=1)
    normed = g.op("Div", x, g.op("Sqrt", g.op("Add", mean, g.scalar(norm.eps))))
    return g.op("Mul", normed, g.const(norm.weight.float().numpy(), name))


def rotate(g: GraphBuilder, x: str, cos: str, sin: str, head_dim: int) -> str:
    half = head_dim // 2
    x1, x2 = g.op("Split", x, g.ints([half, half]), axis=-1, outputs=2)
    return g.op("Add", g.op("Mul", x, cos), g.op("Mul", g.op("Concat", g.op("Neg", x2), x1, axis=-1), sin))


def rotary(g: GraphBuilder, positions: str, inv_freq: torch.Tensor) -> tuple[str, str]:
    """cos/sin [batch, 1, seq, head_dim] from position_ids, as ``Decoder.forward`` computes them."""
    pos = g.op("Unsqueeze", g.op("Cast", positions, to=TensorProto.FLOAT), g.ints([-1]))
    freqs = g.op("Mul", pos, g.const(inv_freq.float().numpy(), "rotary.inv_freq"))
    emb = g.op("Unsqueeze", g.op("Concat", freqs, freqs, axis=-1), g.ints([1]))
    return g.op("Cos", emb), g.op("Sin", emb)


def attention_bias(g: GraphBuilder, spec: DecoderSpec, attention_mask: str, past_key: str, ids: str) -> str:
    """Additive mask [batch, 1, 1, seq, total]: causal over cache positions, sliding window, padding."""
    past = g.op("Gather", g.op("Shape", past_key), g.scalar(2, np.int64))
    seq = g.op("Gather", g.op("Shape", ids), g.scalar(1, np.int64))
    total = g.op("Add", past, seq)
    q_idx = g.op("Unsqueeze", g.op("Range", past, total, g.scalar(1, np.int64)), g.ints([-1]))
    k_idx = g.op("Unsqueeze", g.op("Range", g.scalar(0, np.int64), total, g.scalar(1, np.int64)), g.ints([0]))
    allowed = g.op("LessOrEqual", k_idx, q_idx)
    if spec.sliding_window is not None:
        allowed = g.op("And", allowed, g.op("Greater", k_idx, g.op("Sub", q_idx, g.scalar(spec.sliding_window, np.int64))))
    padding = g.op("Unsqueeze", g.op("Cast", attention_mask, to=TensorProto.BOOL), g.ints([1, 2, 3]))
    allowed = g.op("And", g.op("Unsqueeze", allowed, g.ints([0, 1, 2])), padding)
    return g.op("Where", allowed, g.scalar(0.0), g.scalar(MASKED))


def attention(g: GraphBuilder, spec: DecoderSpec, x: str, attn: Attention, i: int, cos: str, sin: str, bias: str) -> str:
    """Grouped-query attention without copying K/V: queries are grouped as [batch, kv, group, seq, dim]."""
    prefix = f"{spec.layer_prefix(i)}.self_attn"
    heads, kv, dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
    names = [f"{prefix}.{name}" for name in ("q_proj", "k_proj", "v_proj")]
    q, k, v = shared_input_linears(g, x, (attn.q_proj, attn.k_proj, attn.v_proj), names, f"{prefix}.qkv_proj")
    q, k, v = (g.op("Reshape", t, g.ints([0, 0, n, dim])) for t, n in ((q, heads), (k, kv), (v, kv)))
    if spec.qk_norm:
        q = rms_norm(g, q, attn.q_norm, f"{prefix}.q_norm.weight")
        k = rms_norm(g, k, attn.k_norm, f"{prefix}.k_norm.weight")
    q = rotate(g, g.op("Transpose", q, perm=[0, 2, 1, 3]), cos, sin, dim)
    k = rotate(g, g.op("Transpose", k, perm=[0, 2, 1, 3]), cos, sin, dim)
    v = g.op("Transpose", v, perm=[0, 2, 1, 3])
    present_k, present_v = present_names(i)
    for past, new, present in zip(past_names(i), (k, v), (present_k, present_v)):
        g.op("Concat", past, new, axis=2, outputs=[present])
    q5 = g.op("Reshape", q, g.ints([0, kv, heads // kv, -1, dim]))
    keys_t = g.op("Unsqueeze", g.op("Transpose", present_k, perm=[0, 1, 3, 2]), g.ints([2]))
    scores = g.op("Add", g.op("Mul", g.op("MatMul", q5, keys_t), g.scalar(dim**-0.5)), bias)
    context = g.op("MatMul", g.op("Softmax", scores, axis=-1), g.op("Unsqueeze", present_v, g.ints([2])))
    context = g.op("Transpose", g.op("Reshape", context, g.ints([0, heads, -1, dim])), perm=[0, 2, 1, 3])
    return linear(g, g.op("Reshape", context, g.ints([0, 0, heads * dim])), attn.o_proj, f"{prefix}.o_proj")


def mlp(g: GraphBuilder, x: str, block: MLP, prefix: str) -> str:
    names = [f"{prefix}.gate_proj", f"{prefix}.up_proj"]
    gate, up = shared_input_linears(g, x, (block.gate_proj, block.up_proj), names, f"{prefix}.gate_up_proj")
    return linear(g, g.op("Mul", g.op("Mul", gate, g.op("Sigmoid", gate)), up), block.down_proj, f"{prefix}.down_proj")


Fill = Callable[[np.ndarray], None]
HIDDEN = ONNX_HIDDEN_OUTPUT  # the output of a graph whose lm_head is computed outside it
HEAD_OUTSIDE = "outside"
BFLOAT16 = np.dtype(ml_dtypes.bfloat16)  # numpy's bfloat16, from onnx's own dependency
FLOAT32 = np.dtype(np.float32)


def build_graph(
    g: GraphBuilder,
    spec: DecoderSpec,
    name: str,
    inv_freq: torch.Tensor,
    embed: Fill,
    layers: Iterable[DecoderLayer],
    norm: RMSNorm,
    head: Fill | Linear | None,
    table_dtype: np.dtype = FLOAT32,
) -> onnx.ModelProto:
    """The decoder graph from its parts, ``layers`` built one at a time; ``head``: a [hidden, vocab] fill, the int8 lm_head,
    None (tied) or ``HEAD_OUTSIDE`` (the graph ends in ``hidden_states``); ``table_dtype``: float32 or ``BFLOAT16``."""
    cos, sin = rotary(g, "position_ids", inv_freq)
    bias = attention_bias(g, spec, "attention_mask", past_names(0)[0], "input_ids")
    table = g.const_filled("model.embed_tokens.weight", table_dtype, (spec.vocab_size, spec.hidden_size), embed)
    x = g.op("Gather", table, "input_ids")
    if table_dtype != np.float32:
        x = g.op("Cast", x, to=TensorProto.FLOAT)
    for i, layer in enumerate(layers):
        p = spec.layer_prefix(i)
        normed = rms_norm(g, x, layer.input_layernorm, f"{p}.input_layernorm.weight")
        x = g.op("Add", x, attention(g, spec, normed, layer.self_attn, i, cos, sin, bias))
        normed = rms_norm(g, x, layer.post_attention_layernorm, f"{p}.post_attention_layernorm.weight")
        x = g.op("Add", x, mlp(g, normed, layer.mlp, f"{p}.mlp"))
    normed = rms_norm(g, x, norm, "model.norm.weight")
    if head is HEAD_OUTSIDE:
        g.op("Identity", normed, outputs=[HIDDEN])
    elif isinstance(head, Linear):
        g.op("Identity", linear(g, normed, head, "lm_head"), outputs=["logits"])
    else:
        if head is None:  # tied: one copy on disk; ORT folds the transpose at load, or above 1 GiB fuses it into the MatMul
            weight_t = g.op("Transpose", table, perm=[1, 0])
        else:
            weight_t = g.const_filled("lm_head.weight_t", np.float32, (spec.hidden_size, spec.vocab_size), head)
        g.op("MatMul", normed, weight_t, outputs=["logits"])

    cache_shape = [BATCH, spec.num_kv_heads, PAST, spec.head_dim]
    present_shape = [BATCH, spec.num_kv_heads, TOTAL, spec.head_dim]
    ids = (("input_ids", SEQUENCE), ("attention_mask", TOTAL), ("position_ids", SEQUENCE))
    inputs = [helper.make_tensor_value_info(name, TensorProto.INT64, [BATCH, axis]) for name, axis in ids]
    out, width = (HIDDEN, spec.hidden_size) if head is HEAD_OUTSIDE else ("logits", spec.vocab_size)
    outputs = [helper.make_tensor_value_info(out, TensorProto.FLOAT, [BATCH, SEQUENCE, width])]
    for i in range(spec.num_layers):
        inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, cache_shape) for n in past_names(i)]
        outputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, present_shape) for n in present_names(i)]
    return g.model(name, inputs, outputs)
