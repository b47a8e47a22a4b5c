"""Timing the exported ONNX forms on ONNX Runtime: ``quasar-deploy bench onnx layers|step|fidelity``.

``layers``: the W8A8 linear's ``integer`` and ``qdq`` forms against a float32 MatMul, on a chain of distinct weights (ORT
shares identical initializers); ``step``: a verify step on ONNX Runtime's graphs and the cpu backend's decoders, round
robin; ``fidelity``: an export against the torch decoder. Each yields its report line by line (a run takes minutes)."""

from __future__ import annotations

import gc
import math
import os
import statistics
import tempfile
from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from ..errors import QuasarError

try:
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper
except ImportError:
    raise QuasarError("bench onnx needs onnx and onnxruntime: pip install 'quasar-deploy[onnx]'") from None

from ..artifact import open_model_files
from ..backends.onnxruntime import load_onnx_export
from ..backends.ort_session import PRECISE_INT8_OPTION, bit_exact_int8_entries, head_beside, session_options
from ..backends.registry import cpu_runs_better
from ..backends.torch_backend import bind_cpu_attention, load_cpu
from ..calibration.data import read_texts
from ..cpu.choice import default_int8_kernel
from ..cpu.linears import default_float_dtype, default_float_kernel, dtype_name, head_beside_graph
from ..cpu.machine import cpu_model
from ..decoder_spec import DecoderSpec, expected_shapes
from ..exporters import ONNX_HEAD_FILE, ONNX_HIDDEN_OUTPUT
from ..exporters.onnx import source_graph, write_graph
from ..exporters.onnx_graph import LINEAR_FORMATS, GraphBuilder
from ..memory import EMBEDDINGS, return_freed_memory
from ..model import Decoder
from ..scheme import QMAX, quantize_weight, reference_linear
from ..speculative.cascade import StepCost, modelled_gain
from ..tokenizer import load_tokenizer
from .e2e import PAPER_ACCEPTANCE
from .memory import GB, check_fits, fits
from .micro import settled, time_step, timed
from .synthetic import (
    LIBRARIES_BYTES,
    STORED_DTYPE,
    RandomTensors,
    engine_alone_bytes,
    engines_peak_bytes,
    is_layer_linear,
    step_read_bytes,
    synthetic_decoders,
    synthetic_spec,
    w8a8_source,
)


def _session(
    model_or_path: Path | onnx.ModelProto, threads: int, precise: bool = False, head_on_torch: bool = False
) -> ort.InferenceSession:
    """A CPU session with the backend's options; ``precise`` forces ORT's u8 x u8 re-encoding of int8 weights."""
    options = session_options(threads, head_on_torch)
    if precise and PRECISE_INT8_OPTION not in bit_exact_int8_entries():
        options.add_session_config_entry(*PRECISE_INT8_OPTION)
    source = str(model_or_path) if isinstance(model_or_path, Path) else model_or_path.SerializeToString()
    return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])


def _median_ms(sess: ort.InferenceSession, feed: dict, repeats: int) -> float:
    sess.run(None, feed)
    return 1e3 * statistics.median(timed(partial(sess.run, None, feed)) for _ in range(repeats))


def _chain(weights: list[tuple[torch.Tensor, torch.Tensor]], form: str, input_scales: list[float]) -> onnx.ModelProto:
    """y = linear_n(...linear_1(x)): dequantized ``fp32`` MatMuls, or W8A8 ``integer`` or ``qdq`` (``input_scales``) linears."""
    g, x = GraphBuilder(), "x"
    for i, ((wq, scale), input_scale) in enumerate(zip(weights, input_scales)):
        if form == "fp32":
            x = g.op("MatMul", x, g.const((wq.float() * scale).numpy().T, f"layer{i}.weight_t"))
        else:
            x = LINEAR_FORMATS[form](g, x, wq.numpy(), scale.numpy(), input_scale if form == "qdq" else None, f"layer{i}")
    g.op("Identity", x, outputs=["y"])
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["m", weights[0][0].shape[1]]) for n in ("x", "y")]
    return g.model("chain", io[:1], io[1:])


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
    sessions["u8u8"] = _session(_chain(weights, "integer", input_scales), threads, precise=True)
    integer = _session(_chain(weights[:1], "integer", input_scales), threads).run(None, {"x": x.numpy()})[0]
    qdq = _session(_chain(weights[:1], "qdq", input_scales), threads).run(None, {"x": x.numpy()})[0]
    static = reference_linear(x, *weights[0], input_scale=torch.tensor([input_scales[0]]))
    yield (
        f"{size}x{size}, {depth} distinct layers, {threads} threads; integer linear bit-exact to scheme.reference_linear: "
        f"{torch.equal(torch.from_numpy(integer), reference_linear(x, *weights[0]))}; qdq linear (static scales) within float "
        f"rounding of it: {torch.allclose(torch.from_numpy(qdq), static, rtol=1e-6, atol=0)}; the backend's int8 options "
        f"here: {dict(bit_exact_int8_entries()) or 'none (u8 x s8 is exact on this CPU)'}"
    )
    for m in rows:
        feed = {"x": np.random.default_rng(m).standard_normal((m, size), dtype=np.float32)}
        t = {k: _median_ms(s, feed, repeats) / depth for k, s in sessions.items()}
        yield (
            f"M={m:<4d} fp32 MatMul {t['fp32']:8.3f} ms/layer   integer {t['integer']:8.3f} ms/layer ({t['fp32'] / t['integer']:.2f}x)"
            f"   integer re-encoded u8 x u8 {t['u8u8']:8.3f} ms/layer ({t['fp32'] / t['u8u8']:.2f}x)"
            f"   qdq {t['qdq']:8.3f} ms/layer ({t['fp32'] / t['qdq']:.2f}x; qdq/integer time {t['qdq'] / t['integer']:.2f})"
        )


def _ort_feed(spec, ids: np.ndarray, context: int, rng: np.random.Generator) -> dict:
    """A verify of ``ids`` on a ``context``-token cache of random keys and values (what a step reads, not what it means)."""
    n = len(ids)
    return {
        "input_ids": ids[None],
        "position_ids": np.arange(context, context + n)[None],
        "attention_mask": np.ones((1, context + n), np.int64),
        **{
            f"past_key_values.{i}.{kv}": rng.standard_normal((1, spec.num_kv_heads, context, spec.head_dim), dtype=np.float32)
            for i in range(spec.num_layers)
            for kv in ("key", "value")
        },
    }


def _graph_bytes(spec) -> tuple[int, int]:
    """The float and W8A8 graphs' weights: float32 or int8 linears, float32 embedding table and lm_head (bounding an int8 one)."""
    linears = sum(math.prod(shape) for name, shape in expected_shapes(spec).items() if is_layer_linear(name))
    table = 4 * spec.vocab_size * spec.hidden_size * (1 if spec.tie_word_embeddings else 2)
    return 4 * linears + table, linears + table


# measured peaks (docs/onnx.md): a graph build's of its embedding table, a session's and its build's of the graph's weights
GRAPH_BUILD_FACTOR = 3
SESSION_FACTOR = 1.2
SESSION_BUILD_FACTOR = 1.6


def step_peak_bytes(spec: DecoderSpec, with_torch: bool, int8_lm_head: bool = False, float_itemsize: int = 4) -> int:
    """Peak of ``step`` together: each graph's build and session in turn, then ``with_torch`` the engines beside the sessions."""
    float_graph, w8a8_graph = _graph_bytes(spec)
    build = GRAPH_BUILD_FACTOR * 4 * spec.vocab_size * spec.hidden_size
    float_session = SESSION_FACTOR * float_graph
    sessions = float_session + SESSION_BUILD_FACTOR * w8a8_graph  # the W8A8 session's build, or what it then holds
    graphs = int(max(build, SESSION_BUILD_FACTOR * float_graph, float_session + build, sessions)) + LIBRARIES_BYTES
    return max(graphs, int(sessions) + engines_peak_bytes(spec, int8_lm_head, float_itemsize)) if with_torch else graphs


def write_synthetic_graph(directory: Path, spec: DecoderSpec, source: RandomTensors, name: str, head_outside: bool = False) -> None:
    """The graph of ``source``'s random weights in ``directory``, streamed layer by layer as an export is."""
    write_graph(directory, lambda data: source_graph(spec, source, name, data, head_outside=head_outside)[0], external=True)


# exact mode's model needs the float step's cost at a cascade draft's lengths too (up to 8 rounds of 1.4 tokens)
EXACT_FLOAT_POSITIONS = (2, 4, 8, 12)
# the float model's per-token acceptance of W8A8's greedy tokens, which random weights cannot measure (bench e2e's can)
EXACT_ACCEPTANCE = 0.985


# a contender built: its timed step (seconds), and its steps at exact mode's longer positions (the float decoder's only)
_Built = tuple[Callable[[], float], dict[int, Callable[[], float]]]


def _ort_contender(
    directory: Path, label: str, source_spec: DecoderSpec, source: RandomTensors, head_outside: bool, feed: dict, threads: int
) -> _Built:
    """The graph of ``source`` written to ``directory`` and its session: its timed step (with the head beside, as the backend)."""
    directory.mkdir()
    write_synthetic_graph(directory, source_spec, source, label, head_outside=head_outside)
    return_freed_memory()
    session = _session(directory / "model.onnx", threads, head_on_torch=head_outside)
    return_freed_memory()
    if head_outside:
        head = head_beside(source.tensor(EMBEDDINGS if source_spec.tie_word_embeddings else "lm_head.weight"))
        return partial(timed, lambda: head(torch.from_numpy(session.run([ONNX_HIDDEN_OUTPUT], feed)[0][0]))), {}
    return partial(timed, partial(session.run, None, feed)), {}


@dataclass(frozen=True)
class _Contender:
    """One contender of ``step``: what it holds resident built alone, and how to build it."""

    label: str
    alone_bytes: int
    build: Callable[[], _Built]


def step(
    shape: str,
    tokens: int,
    context: int,
    threads: int,
    repeats: int,
    with_torch: bool = True,
    int8_lm_head: bool = False,
    w8a8_acceptance: float | None = None,
    progress: bool = True,
) -> Iterator[str]:
    """Every CPU path's verify step on the same synthetic weights (ONNX Runtime's float and integer-exact W8A8 graphs, the cpu
    backend's decoders ``with_torch``), round robin where they fit in memory together, else one at a time."""
    spec = synthetic_spec(shape)
    dtype = default_float_dtype("cpu")
    rng = np.random.default_rng(0)
    ids = rng.integers(0, spec.vocab_size, tokens)
    feed = _ort_feed(spec, ids, context, rng)
    # the W8A8 graph ONNX Runtime runs here: without its float head where that runs better on torch beside it
    outside = head_beside_graph(STORED_DTYPE) and not int8_lm_head
    kernels = default_float_kernel(), default_int8_kernel()
    # "(auto)" marks the W8A8 contender auto gives an artifact here (where memory allows): ``registry.cpu_runs_better``
    on_cpu = cpu_runs_better(artifact=True)
    head_label = "bf16 head" if dtype == torch.bfloat16 else "quasar-half head"
    w8a8_label = (f"ORT W8A8 + {head_label}" if outside else "ORT W8A8 integer") + ("" if on_cpu else " (auto)")
    float_label = f"torch float {dtype_name(dtype)} {kernels[0]}"
    w8a8_torch_label = f"torch W8A8 {kernels[1]}" + (" (auto)" if on_cpu else "")
    together = step_peak_bytes(spec, with_torch, int8_lm_head, dtype.itemsize)
    float_at: dict[int, list[float]] = {n: [] for n in EXACT_FLOAT_POSITIONS}  # exact mode's longer float steps
    longer = torch.from_numpy(rng.integers(0, spec.vocab_size, max(EXACT_FLOAT_POSITIONS)))
    float_bytes = step_read_bytes(spec, quantized=False, float_itemsize=dtype.itemsize)
    ideal = float_bytes / step_read_bytes(spec, quantized=True, int8_lm_head=int8_lm_head, float_itemsize=dtype.itemsize)
    with tempfile.TemporaryDirectory() as tmp:
        graphs = {"ORT fp32": (spec, RandomTensors(spec), False), w8a8_label: (*w8a8_source(shape, int8_lm_head=int8_lm_head), outside)}
        contenders = _graph_contenders(Path(tmp), spec, graphs, feed, threads)
        round_robin = fits(together)
        labels = (float_label, w8a8_torch_label) if with_torch else ()
        if round_robin:
            times = _round_robin(contenders, shape, kernels, dtype, labels, int8_lm_head, context, ids, longer, float_at, repeats, progress)
            how, left_out = f"{repeats} rounds", []
        else:
            steps = partial(_torch_contender, kernels=kernels, context=context, ids=ids, longer=longer)
            contenders += _torch_contenders_alone(spec, shape, dtype, labels, int8_lm_head, steps)
            if not any(fits(c.alone_bytes) for c in contenders):
                check_fits(min(c.alone_bytes for c in contenders), f"bench onnx step --synthetic {shape}, one contender at a time")
            bar = tqdm(contenders, desc=f"onnx step {shape}: contenders", disable=not progress)
            times, left_out = _one_at_a_time(bar, float_at, repeats)
            how = f"{repeats} calls each, one contender at a time (together they need ~{together / GB:.1f} GB)"
    floats = [label for label in times if "W8A8" not in label]
    head = "an int8" if int8_lm_head else "a float"
    yield (
        f"{shape} (synthetic weights, W8A8 with {head} lm_head), {tokens}-token verify on a {context}-token cache, "
        f"{threads} threads, {how}; {cpu_model()}, float dtype {dtype_name(dtype)}"
    )
    for label, series in times.items():
        speedup = "" if label in floats or not floats else f"   {_speedup(times, floats, series, round_robin):.2f}x the best float"
        yield f"  {label:<30} {1e3 * statistics.median(series):8.1f} ms (median){speedup}"
    yield from left_out
    yield f"  ideal W8A8 speed-up by weight bytes read, against {dtype_name(dtype)} float: {ideal:.2f}x"
    if float_label in times:
        middles = {label: series for label, series in times.items() if label not in floats}
        acceptance = EXACT_ACCEPTANCE if w8a8_acceptance is None else w8a8_acceptance
        yield from _exact_mode(float_label, times[float_label], float_at, middles, tokens, acceptance)


def _graph_contenders(
    tmp: Path, spec: DecoderSpec, graphs: dict[str, tuple[DecoderSpec, RandomTensors, bool]], feed: dict, threads: int
) -> list[_Contender]:
    """ONNX Runtime's contenders, label -> (spec, source, head outside the graph), each built in a directory of ``tmp``."""
    float_graph, w8a8_graph = _graph_bytes(spec)
    build = GRAPH_BUILD_FACTOR * 4 * spec.vocab_size * spec.hidden_size
    return [
        _Contender(
            label,
            int(max(build, SESSION_BUILD_FACTOR * (w8a8_graph if graph[1].quantized else float_graph))) + LIBRARIES_BYTES,
            partial(_ort_contender, tmp / str(i), label, *graph, feed, threads),
        )
        for i, (label, graph) in enumerate(graphs.items())
    ]


def _torch_contenders_alone(
    spec: DecoderSpec, shape: str, dtype: torch.dtype, labels: tuple[str, ...], int8_lm_head: bool, steps: Callable[..., _Built]
) -> list[_Contender]:
    """The cpu backend's float and W8A8 decoders (``labels``), each to be built alone by ``steps``, the W8A8 one's own head."""
    if not labels:
        return []
    alone = partial(engine_alone_bytes, spec, int8_lm_head=int8_lm_head, float_itemsize=dtype.itemsize)
    quant_source = w8a8_source(shape, int8_lm_head=int8_lm_head)
    makes = (partial(Decoder, spec, RandomTensors(spec), dtype), partial(Decoder, *quant_source, head_dtype=dtype))
    return [
        _Contender(label, alone(quantized=quantized), partial(steps, make, positions=() if quantized else EXACT_FLOAT_POSITIONS))
        for label, make, quantized in zip(labels, makes, (False, True))
    ]


def _speedup(times: dict[str, list[float]], floats: list[str], series: list[float], round_robin: bool) -> float:
    """Round robin: the median of per-round ratios against the round's fastest float; else a ratio of medians."""
    if not round_robin:
        return min(statistics.median(times[label]) for label in floats) / statistics.median(series)
    best_float = [min(times[label][i] for label in floats) for i in range(len(series))]
    return statistics.median(b / t for b, t in zip(best_float, series))


def _round_robin(
    contenders: list[_Contender],
    shape: str,
    kernels: tuple[str, str],
    dtype: torch.dtype,
    labels: tuple[str, ...],
    int8_lm_head: bool,
    context: int,
    ids: np.ndarray,
    longer: torch.Tensor,
    float_at: dict[int, list[float]],
    repeats: int,
    progress: bool,
) -> dict[str, list[float]]:
    """Every contender built beside the others, then ``repeats`` rounds timing each once; the longer float steps after."""
    built = {c.label: c.build() for c in contenders}
    if labels:
        decoders = synthetic_decoders(shape, kernels=kernels, int8_lm_head=int8_lm_head, dtype=dtype)
        for label, decoder in zip(labels, decoders):
            built[label] = _decoder_steps(decoder, context, ids, longer, EXACT_FLOAT_POSITIONS if decoder is decoders[0] else ())
    steps = {label: run for label, (run, _) in built.items()}
    for run in steps.values():
        run()  # warm-up
    times: dict[str, list[float]] = {label: [] for label in steps}
    for _ in tqdm(range(repeats), desc=f"onnx step {shape}: rounds", disable=not progress):
        for label, run in steps.items():
            times[label].append(settled(run))
    for _, at in built.values():
        _time_positions(at, float_at, repeats)
    return times


def _one_at_a_time(
    contenders: Iterable[_Contender], float_at: dict[int, list[float]], repeats: int
) -> tuple[dict[str, list[float]], list[str]]:
    """Each contender that fits alone built, timed and freed before the next: their times, and a line per one left out."""
    times: dict[str, list[float]] = {}
    left_out = []
    for contender in contenders:
        if not fits(contender.alone_bytes):
            left_out.append(f"  {contender.label:<30} left out: it needs ~{contender.alone_bytes / GB:.1f} GB alone")
            continue
        run, at = contender.build()
        os.sync()  # a graph's build leaves gigabytes of dirty pages: written back meanwhile, they slow the timed calls
        run()  # warm-up
        times[contender.label] = [settled(run) for _ in range(repeats)]
        _time_positions(at, float_at, repeats)
        del run, at
        gc.collect()
        return_freed_memory()
    return times, left_out


def _decoder_steps(decoder: Decoder, context: int, ids: np.ndarray, longer: torch.Tensor, positions: Collection[int]) -> _Built:
    """A prepared decoder's verify step of ``ids`` on a ``context``-token cache, and its steps at each of ``positions``."""
    cache = decoder.new_cache(context + max(len(ids), *EXACT_FLOAT_POSITIONS))
    decoder(torch.randint(0, decoder.spec.vocab_size, (context,), generator=torch.Generator().manual_seed(0)), cache)
    at = {n: partial(time_step, decoder, cache, context, longer[:n]) for n in positions}
    return partial(time_step, decoder, cache, context, torch.from_numpy(ids)), at


def _torch_contender(
    make: Callable[[], Decoder],
    *,
    kernels: tuple[str, str],
    context: int,
    ids: np.ndarray,
    longer: torch.Tensor,
    positions: Collection[int],
) -> _Built:
    """A torch decoder built alone (``make``) and prepared with ``kernels``: its steps (``_decoder_steps``)."""
    decoder = make()
    decoder.prepare(*kernels, fuse=True)
    bind_cpu_attention(decoder)
    return _decoder_steps(decoder, context, ids, longer, positions)


def _time_positions(steps: dict[int, Callable[[], float]], float_at: dict[int, list[float]], repeats: int) -> None:
    """``repeats`` rounds of a decoder's steps at exact mode's longer positions (none but the float one's), into ``float_at``."""
    for _ in range(repeats if steps else 0):
        for positions, run in steps.items():
            float_at[positions].append(settled(run))


def _exact_mode(
    float_label: str,
    float_times: list[float],
    float_at: dict[int, list[float]],
    middles: dict[str, list[float]],
    tokens: int,
    acceptance: float,
) -> Iterator[str]:
    """Exact mode's speed model (``cascade.modelled_gain``) at the paper's acceptance, each W8A8 contender as the middle."""
    verify_cost = StepCost()
    for seconds in float_times:
        verify_cost.observe(tokens, seconds)
    for i in range(min(map(len, float_at.values()))):  # in the order they ran: recent forwards weigh more in the fit
        for positions, series in float_at.items():
            verify_cost.observe(positions, series[i])
    yield (
        f"  exact mode at acceptance {PAPER_ACCEPTANCE} (n-gram k={tokens - 1}; {float_label} verifying, timed at "
        f"{', '.join(map(str, (tokens, *EXACT_FLOAT_POSITIONS)))} positions; it keeps {acceptance:.3f} of W8A8's tokens):"
    )
    for label, series in middles.items():
        middle_cost = StepCost()
        for seconds in series:
            middle_cost.observe(tokens, seconds)
        rounds, gain = modelled_gain(PAPER_ACCEPTANCE, tokens - 1, acceptance, middle_cost, verify_cost)
        yield f"    W8A8 rounds on {label:<28} {rounds} per float step: {gain:.2f}x plain float n-gram verification"


def _greedy(lm, prompt: list[int], steps: int) -> list[int]:
    logits, tokens = lm.prefill(prompt), []
    for _ in range(steps):
        tokens.append(int(logits.argmax()))
        logits = lm.verify(tokens[-1:])[-1]
    return tokens


def fidelity(
    exported: Path, source: Path, steps: int, threads: int, prompts: Path | None = None, limit: int | None = None
) -> Iterator[str]:
    """Per prompt, then over all: ``exported`` on ONNX Runtime against ``source`` on torch, greedy and teacher-forced."""
    # the torch reference computes the head as the export does: in the graph, float32; beside it, in the CPU's float dtype
    head_dtype = None if (Path(exported) / ONNX_HEAD_FILE).is_file() else "float32"
    onnx_lm = load_onnx_export(exported, threads=threads)
    files = open_model_files(source)
    torch_lm = load_cpu(files, int8_kernel="reference", threads=threads, float_dtype=head_dtype)
    tokenizer = load_tokenizer(files)
    texts = (read_texts(prompts) if prompts else list(FIDELITY_PROMPTS))[:limit]
    identical = prefix = agree = positions = 0
    for text in texts:
        prompt = list(tokenizer.encode(text))[-(torch_lm.max_length - steps - 1) :]
        ours, theirs = _greedy(onnx_lm, prompt, steps), _greedy(torch_lm, prompt, steps)
        same = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), steps)
        ids = prompt + theirs
        onnx_lm.truncate(0)
        torch_lm.truncate(0)
        a, b = onnx_lm.verify(ids), torch_lm.verify(ids)
        diff = (a - b).abs().max().item()
        top1 = (a.argmax(-1) == b.argmax(-1)).float()
        identical, prefix = identical + (same == steps), prefix + same
        agree, positions = agree + int(top1.sum()), positions + len(ids)
        yield (
            f"{len(ids)} positions: max |logit diff| {diff:.3e} (max |logit| {b.abs().max().item():.1f}), "
            f"top-1 agreement {top1.mean().item():.4f}, greedy identical for {same}/{steps} tokens"
        )
    yield (
        f"ONNX Runtime vs torch, all {len(texts)} prompts of {Path(prompts).name if prompts else 'the built-in three'}: "
        f"greedy text identical on {identical}, mean common prefix {prefix / len(texts):.1f}/{steps} tokens, "
        f"teacher-forced top-1 agreement {agree / positions:.4f}"
    )


FIDELITY_PROMPTS = ("Once upon a time there was a little", "The capital of France is", "def fibonacci(n):")
