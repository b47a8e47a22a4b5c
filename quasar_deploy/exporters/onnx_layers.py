"""The decoder as small ONNX graphs over stacked rows, for the batched ONNX Runtime decoder (``backends/onnx_layered``).

Per layer, ``attention_inputs`` and ``layer_output`` on rows of several sequences, and between them each sequence's
``attention`` (ORT's ``GroupQueryAttention``, writing the cache in place). Every row-graph op works row by row, so a
request's output is the same alone and among others. The linears take ``onnx_graph``'s ``integer`` form."""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from ..decoder_spec import DecoderSpec
from ..model import DecoderLayer, Linear, RMSNorm
from .onnx_graph import GraphBuilder, linear, mlp, rms_norm, rotate, shared_input_linears

ROWS = "rows"
X, COS, SIN, CTX, Q, K, V, Y = "x", "cos", "sin", "context", "q", "k", "v", "y"
CACHE_KEY, CACHE_VALUE, SEQLEN, TOTAL = "cache_key", "cache_value", "seqlens_k", "total_sequence_length"
CONTRIB = "com.microsoft"


def _value(name: str, shape: list, dtype: int = TensorProto.FLOAT) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, dtype, shape)


def _serialized(g: GraphBuilder, name: str, inputs: list, outputs: list, domains: tuple = ()) -> bytes:
    return g.model(name, inputs, outputs, domains).SerializeToString()


def attention_inputs(spec: DecoderSpec, layer: DecoderLayer, i: int) -> bytes:
    """x, cos, sin [rows, ...] -> q, k, v: the input norm, the q/k/v projections, the q/k norms and rotary."""
    g = GraphBuilder("integer")
    p, attn = f"{spec.layer_prefix(i)}.self_attn", layer.self_attn
    heads, kv, dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
    normed = rms_norm(g, X, layer.input_layernorm, f"{spec.layer_prefix(i)}.input_layernorm.weight")
    names = [f"{p}.{n}" for n in ("q_proj", "k_proj", "v_proj")]
    q, k, v = shared_input_linears(g, normed, (attn.q_proj, attn.k_proj, attn.v_proj), names, f"{p}.qkv_proj")
    q, k = g.op("Reshape", q, g.ints([0, heads, dim])), g.op("Reshape", k, g.ints([0, kv, dim]))
    if spec.qk_norm:
        q, k = rms_norm(g, q, attn.q_norm, f"{p}.q_norm.weight"), rms_norm(g, k, attn.k_norm, f"{p}.k_norm.weight")
    cos, sin = g.op("Unsqueeze", COS, g.ints([1])), g.op("Unsqueeze", SIN, g.ints([1]))
    g.op("Reshape", rotate(g, q, cos, sin, dim), g.ints([0, heads * dim]), outputs=[Q])
    g.op("Reshape", rotate(g, k, cos, sin, dim), g.ints([0, kv * dim]), outputs=[K])
    g.op("Identity", v, outputs=[V])
    inputs = [_value(X, [ROWS, spec.hidden_size]), _value(COS, [ROWS, dim]), _value(SIN, [ROWS, dim])]
    outputs = [_value(Q, [ROWS, heads * dim]), _value(K, [ROWS, kv * dim]), _value(V, [ROWS, kv * dim])]
    return _serialized(g, f"layer{i}.attention_inputs", inputs, outputs)


def layer_output(spec: DecoderSpec, layer: DecoderLayer, i: int) -> bytes:
    """x [rows, hidden], context [rows, heads * dim] -> y [rows, hidden]: the rest of the layer."""
    g = GraphBuilder("integer")
    p = spec.layer_prefix(i)
    x = g.op("Add", X, linear(g, CTX, layer.self_attn.o_proj, f"{p}.self_attn.o_proj"))
    normed = rms_norm(g, x, layer.post_attention_layernorm, f"{p}.post_attention_layernorm.weight")
    x = g.op("Add", x, mlp(g, normed, layer.mlp, f"{p}.mlp"))
    g.op("Identity", x, outputs=[Y])
    inputs = [_value(X, [ROWS, spec.hidden_size]), _value(CTX, [ROWS, spec.num_heads * spec.head_dim])]
    return _serialized(g, f"layer{i}.output", inputs, [_value(Y, [ROWS, spec.hidden_size])])


def final_norm(spec: DecoderSpec, norm: RMSNorm) -> bytes:
    """x [rows, hidden] -> y: the model's last norm (its own graph: a layerskip draft may skip the last layer)."""
    g = GraphBuilder("integer")
    g.op("Identity", rms_norm(g, X, norm, "model.norm.weight"), outputs=[Y])
    return _serialized(g, "final_norm", [_value(X, [ROWS, spec.hidden_size])], [_value(Y, [ROWS, spec.hidden_size])])


def int8_head(spec: DecoderSpec, head: Linear) -> bytes:
    """hidden [rows, hidden] -> y [rows, vocab]: an int8 lm_head, the same W8A8 linear as the layers'."""
    g = GraphBuilder("integer")
    g.op("Identity", linear(g, X, head, "lm_head"), outputs=[Y])
    return _serialized(g, "lm_head", [_value(X, [ROWS, spec.hidden_size])], [_value(Y, [ROWS, spec.vocab_size])])


def attention(spec: DecoderSpec) -> bytes:
    """One sequence's attention over its cache [1, kv_heads, capacity, dim], into which its n new keys and values are
    written at ``seqlens_k + 1 - n .. seqlens_k`` (the output cache is bound to the input's buffer)."""
    g = GraphBuilder("integer")
    heads, kv, dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
    attrs = dict(domain=CONTRIB, num_heads=heads, kv_num_heads=kv, scale=float(dim**-0.5))
    key_out, value_out = f"{CACHE_KEY}_out", f"{CACHE_VALUE}_out"
    g.op("GroupQueryAttention", Q, K, V, CACHE_KEY, CACHE_VALUE, SEQLEN, TOTAL, outputs=[Y, key_out, value_out], **attrs)
    cache = [1, kv, "capacity", dim]
    inputs = [_value(Q, [1, "n", heads * dim]), _value(K, [1, "n", kv * dim]), _value(V, [1, "n", kv * dim]), _value(CACHE_KEY, cache)]
    inputs += [_value(CACHE_VALUE, cache), _value(SEQLEN, [1], TensorProto.INT32), _value(TOTAL, [], TensorProto.INT32)]
    outputs = [_value(Y, [1, "n", heads * dim]), _value(key_out, cache), _value(value_out, cache)]
    return _serialized(g, "attention", inputs, outputs, ((CONTRIB, 1),))
