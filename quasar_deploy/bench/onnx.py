"""Timing the exported ONNX forms on ONNX Runtime: ``quasar-deploy bench onnx layers|step|fidelity``.

``layers``: the exported W8A8 linear in both forms (``integer``: ``onnx_graph.w8a8_linear``, per-token
scales; ``qdq``: ``onnx_graph.qdq_linear``, static scales) against a float32 MatMul of the same shape,
a chain of distinct weights (ORT shares identical initializers, which would put every layer's
weights in cache), plus a check of each form against ``scheme.reference_linear``.
``fidelity``: an exported directory on the onnxruntime backend against the torch decoder with the
exact reference int8 kernel (or float), teacher-forced logits and greedy continuations.
``step``: whole decoder graphs of a published shape with synthetic weights, float vs W8A8,
timing a k+1-token verify and a one-token decode on a warm cache. Numbers are per call,
median of the repeats; docs/onnx.md records what they gave here. Each yields its report line by
line, since a run takes minutes.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from ..errors import QuasarError

try:
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper
except ImportError:
    raise QuasarError("bench onnx needs onnx and onnxruntime: pip install 'quasar-deploy[onnx]'") from None

from ..backends.onnxruntime import EXACT_QUANT_OPTION
from ..exporters.onnx import save_graph
from ..exporters.onnx_graph import LINEAR_FORMATS, OPSET, GraphBuilder, decoder_graph
from ..scheme import QMAX, quantize_weight, reference_linear
from .synthetic import synthetic_decoders


def _session(model_or_path: Path | onnx.ModelProto, threads: int) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.add_session_config_entry(*EXACT_QUANT_OPTION)
    source = str(model_or_path) if isinstance(model_or_path, Path) else model_or_path.SerializeToString()
    return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])


def _median_ms(sess: ort.InferenceSession, feed: dict, repeats: int) -> float:
    """One warm-up call, then the median of ``repeats`` timed ones."""
    sess.run(None, feed)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        sess.run(None, feed)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def _chain(weights: list[tuple[torch.Tensor, torch.Tensor]], form: str, input_scales: list[float]) -> onnx.ModelProto:
    """y = linear_n(...linear_1(x)) with the given (int8 weight, scale) pairs: dequantized ``fp32`` MatMuls, or W8A8 in
    the ``integer`` form (per-token scales) or the ``qdq`` form (``input_scales``, one static scale per layer)."""
    g, x = GraphBuilder(), "x"
    for i, ((wq, scale), input_scale) in enumerate(zip(weights, input_scales)):
        if form == "fp32":
            x = g.op("MatMul", x, g.const((wq.float() * scale).numpy().T, f"layer{i}.weight_t"))
        else:
            x = LINEAR_FORMATS[form](g, x, wq.numpy(), scale.numpy(), input_scale if form == "qdq" else None, f"layer{i}")
    g.op("Identity", x, outputs=["y"])
    size = weights[0][0].shape[1]
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["m", size]) for n in ("x", "y")]
    return helper.make_model(
        helper.make_graph(g.nodes, "chain", io[:1], io[1:], g.initializers), opset_imports=[helper.make_opsetid("", OPSET)]
    )


def _static_scales(weights: list[tuple[torch.Tensor, torch.Tensor]], x: torch.Tensor) -> list[float]:
    """Each layer's per-tensor scale as a calibration would set it: max |input| / 127 on ``x`` run through the float chain."""
    scales = []
    for wq, scale in weights:
        scales.append(x.abs().max().item() / QMAX)
        x = x @ (wq.float() * scale).t()
    return scales


def layers(size: int, depth: int, rows: tuple[int, ...], threads: int, repeats: int) -> Iterator[str]:
    torch.manual_seed(0)
    weights = [quantize_weight(torch.randn(size, size)) for _ in range(depth)]
    x = torch.randn(8, size)
    x[:, :16] *= 30  # outlier channels: full-range int8 codes, where AVX2 u8 x s8 kernels would overflow
    input_scales = _static_scales(weights, x)
    sessions = {form: _session(_chain(weights, form, input_scales), threads) for form in ("fp32", *LINEAR_FORMATS)}
    integer = _session(_chain(weights[:1], "integer", input_scales), threads).run(None, {"x": x.numpy()})[0]
    qdq = _session(_chain(weights[:1], "qdq", input_scales), threads).run(None, {"x": x.numpy()})[0]
    static = reference_linear(x, *weights[0], input_scale=torch.tensor([input_scales[0]]))
    yield (
        f"{size}x{size}, {depth} distinct layers, {threads} threads; integer linear bit-exact to scheme.reference_linear: "
        f"{torch.equal(torch.from_numpy(integer), reference_linear(x, *weights[0]))}; qdq linear (static scales) within float "
        f"rounding of it: {torch.allclose(torch.from_numpy(qdq), static, rtol=1e-6, atol=0)}"
    )
    for m in rows:
        feed = {"x": np.random.default_rng(m).standard_normal((m, size), dtype=np.float32)}
        t = {k: _median_ms(s, feed, repeats) / depth for k, s in sessions.items()}
        yield (
            f"M={m:<4d} fp32 MatMul {t['fp32']:8.3f} ms/layer   integer {t['integer']:8.3f} ms/layer ({t['fp32'] / t['integer']:.2f}x)"
            f"   qdq {t['qdq']:8.3f} ms/layer ({t['fp32'] / t['qdq']:.2f}x; qdq/integer time {t['qdq'] / t['integer']:.2f})"
        )


def step(shape: str, tokens: int, context: int, threads: int, repeats: int) -> Iterator[str]:
    float_model, w8a8_model = synthetic_decoders(shape)
    spec = float_model.spec
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        for label, decoder in (("fp32", float_model), ("w8a8", w8a8_model)):
            directory = Path(tmp) / label
            directory.mkdir()
            save_graph(decoder_graph(decoder, label), directory)
            sess = _session(directory / "model.onnx", threads)
            cache = {
                f"past_key_values.{i}.{kv}": rng.standard_normal((1, spec.num_kv_heads, context, spec.head_dim), dtype=np.float32)
                for i in range(spec.num_layers)
                for kv in ("key", "value")
            }
            for n in (tokens, 1):
                feed = {
                    "input_ids": rng.integers(0, spec.vocab_size, (1, n)),
                    "position_ids": np.arange(context, context + n)[None],
                    "attention_mask": np.ones((1, context + n), np.int64),
                    **cache,
                }
                ms = _median_ms(sess, feed, repeats)
                yield f"{shape} {label}: {n} token(s) on a {context}-token cache: {ms:8.1f} ms"


def _greedy(lm, prompt: list[int], steps: int) -> list[int]:
    logits, tokens = lm.prefill(prompt), []
    for _ in range(steps):
        tokens.append(int(logits.argmax()))
        logits = lm.verify(tokens[-1:])[-1]
    return tokens


def fidelity(exported: Path, source: Path, steps: int, threads: int) -> Iterator[str]:
    from ..backends.onnxruntime import load_onnx
    from ..backends.torch_backend import load_cpu
    from ..tokenizer import load_tokenizer

    onnx_lm, torch_lm = load_onnx(exported, threads=threads), load_cpu(source, int8_kernel="reference", threads=threads)
    tokenizer = load_tokenizer(source)
    for text in FIDELITY_PROMPTS:
        prompt = list(tokenizer.encode(text))
        ours, theirs = _greedy(onnx_lm, prompt, steps), _greedy(torch_lm, prompt, steps)
        same = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), steps)
        ids = prompt + theirs
        onnx_lm.truncate(0)
        torch_lm.truncate(0)
        a, b = onnx_lm.verify(ids), torch_lm.verify(ids)
        diff = (a - b).abs().max().item()
        top1 = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
        yield (
            f"{len(ids)} positions: max |logit diff| {diff:.3e} (max |logit| {b.abs().max().item():.1f}), "
            f"top-1 agreement {top1:.4f}, greedy identical for {same}/{steps} tokens"
        )


FIDELITY_PROMPTS = ("Once upon a time there was a little", "The capital of France is", "def fibonacci(n):")
