"""Benchmarks. Every speed claim in the docs comes from a function here, reported as a ratio measured in one run.

``verify_step``: the cost of one speculative verify forward (k+1 tokens on a warm
KV cache), float vs W8A8, interleaved pair by pair so machine drift cancels, next
to the ideal ratio of weight bytes each step must read.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from tqdm import tqdm

from ..backends.torch_backend import bind_cpu_attention
from ..cpu.choice import default_int8_kernel
from ..cpu.linears import default_float_dtype, default_float_kernel, dtype_name, int8_kernel_label
from ..cpu.machine import cpu_model
from ..decoder_spec import DecoderSpec
from ..model import Decoder
from .memory import check_fits
from .synthetic import LIBRARIES_BYTES, RandomTensors, engines_peak_bytes, step_read_bytes, synthetic_decoders, synthetic_spec


def weight_bytes(decoder: Decoder) -> int:
    """Bytes of weights one forward step reads (linears and lm_head, a float one in the dtype it computes in or as its
    kernel keeps it, ``Linear.read_itemsize``; the embedding lookup is negligible)."""
    total = 0
    for module in [m for _, m in decoder.linears()] + [decoder.lm_head]:
        total += module.weight.numel() * module.read_itemsize
        if module.weight_scale is not None:
            total += module.weight_scale.numel() * 4
    return total


@dataclass
class VerifyStepResult:
    shape: str
    tokens: int
    context: int
    repeats: int
    float_kernel: str
    int8_kernel: str
    int8_lm_head: bool  # the W8A8 twin's lm_head is int8 too (else a float head in ``head_dtype``)
    head_dtype: str  # what the W8A8 twin's float head computes in (the CPU's float dtype)
    threads: int
    float_ms: dict[str, float]  # median per float contender ("float32", "bfloat16")
    best_float: str  # the fastest float contender: the baseline every ratio is against
    w8a8_ms: float  # median
    ratio: float  # median over rounds of best float time / W8A8 time
    ratio_spread: tuple[float, float]  # min, max over rounds
    ideal_ratio: float  # the best float's weight bytes / W8A8 weight bytes
    fraction_of_ideal: float

    def to_dict(self) -> dict:
        return asdict(self)


def time_step(decoder: Decoder, cache, context: int, ids: torch.Tensor) -> float:
    """Seconds of one forward of ``ids`` on ``cache`` cut back to ``context`` tokens (a verify step, repeatable)."""
    cache.truncate(context)
    start = time.perf_counter()
    decoder(ids, cache)
    return time.perf_counter() - start


def float_contenders() -> tuple[torch.dtype, ...]:
    """The float dtypes a fair baseline must include here: float32, and bf16 where the CPU computes it fast."""
    chosen = default_float_dtype("cpu")
    return (torch.float32,) if chosen == torch.float32 else (torch.float32, chosen)


def verify_step(
    shape: str = "qwen3-0.6b",
    tokens: int = 6,
    context: int = 128,
    repeats: int = 20,
    float_kernel: str | None = None,
    int8_kernel: str | None = None,
    progress: bool = True,
    int8_lm_head: bool = False,
    float_dtypes: tuple[torch.dtype, ...] | None = None,
) -> VerifyStepResult:
    """Synthetic weights of a published shape; W8A8 quantized without calibration (timing only); ``int8_lm_head``
    quantizes the W8A8 twin's head too. Every float contender (``float_contenders``) and the W8A8 twin take turns
    each round; the ratio is against the fastest float, whose bytes give the ideal ratio."""
    float_kernel = float_kernel or default_float_kernel()
    int8_kernel = int8_kernel or default_int8_kernel()
    float_dtypes = float_dtypes or float_contenders()
    head_dtype = float_dtypes[-1]
    spec = synthetic_spec(shape)
    extra_float_twins = (len(float_dtypes) - 1) * step_read_bytes(spec, False)
    check_fits(engines_peak_bytes(spec, int8_lm_head) + extra_float_twins, f"verify-step --synthetic {shape}")
    float_model, quant_model = synthetic_decoders(shape, kernels=(float_kernel, int8_kernel), int8_lm_head=int8_lm_head, dtype=head_dtype)
    models = {head_dtype: float_model}
    for dtype in float_dtypes[:-1]:
        models[dtype] = Decoder(spec, RandomTensors(spec), dtype)
        models[dtype].prepare(float_kernel, int8_kernel, fuse=True)
        bind_cpu_attention(models[dtype])
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, spec.vocab_size, (context,), generator=generator)
    ids = torch.randint(0, spec.vocab_size, (tokens,), generator=generator)
    contenders = {**{dtype_name(d): m for d, m in models.items()}, "w8a8": quant_model}
    caches = {}
    for name, model in contenders.items():
        caches[name] = model.new_cache(context + tokens)
        model(prompt, caches[name])
        time_step(model, caches[name], context, ids)  # warm-up
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in tqdm(range(repeats), desc=f"verify step {shape}", disable=not progress):
        for name, model in contenders.items():
            times[name].append(time_step(model, caches[name], context, ids))
    medians = {name: 1000 * statistics.median(t) for name, t in times.items()}
    best = min((n for n in contenders if n != "w8a8"), key=medians.__getitem__)
    ratios = [f / q for f, q in zip(times[best], times["w8a8"])]
    best_model = next(m for d, m in models.items() if dtype_name(d) == best)
    ideal = weight_bytes(best_model) / weight_bytes(quant_model)
    ratio = statistics.median(ratios)
    return VerifyStepResult(
        shape=shape,
        tokens=tokens,
        context=context,
        repeats=repeats,
        float_kernel=float_kernel,
        int8_kernel=int8_kernel,
        int8_lm_head=int8_lm_head,
        head_dtype=dtype_name(head_dtype),
        threads=torch.get_num_threads(),
        float_ms={n: medians[n] for n in contenders if n != "w8a8"},
        best_float=best,
        w8a8_ms=medians["w8a8"],
        ratio=ratio,
        ratio_spread=(min(ratios), max(ratios)),
        ideal_ratio=ideal,
        fraction_of_ideal=ratio / ideal,
    )


def describe_verify_step(result: VerifyStepResult) -> str:
    low, high = result.ratio_spread
    head = "int8" if result.int8_lm_head else result.head_dtype
    floats = [f"float {name:<9} ({result.float_kernel})  {ms:9.2f} ms" for name, ms in result.float_ms.items()]
    return "\n".join(
        [
            f"verify step, {result.shape} (synthetic weights), {result.tokens} tokens on a {result.context}-token cache; {cpu_model()}",
            f"threads          {result.threads}",
            *floats,
            f"W8A8 ({result.int8_kernel}, {head} lm_head)  {result.w8a8_ms:9.2f} ms",
            f"speed-up         {result.ratio:9.2f}x over the best float, {result.best_float} (median of rounds; {low:.2f}-{high:.2f})",
            f"ideal (bytes)    {result.ideal_ratio:9.2f}x -> {100 * result.fraction_of_ideal:.0f}% of ideal",
        ]
    )


def memory_bandwidth(megabytes: int = 512, repeats: int = 5) -> float:
    """Bytes per second of a large copy (read + write counted), the bound a memory-bound GEMV cannot beat."""
    src = torch.ones(megabytes * 2**20 // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(timed(lambda: dst.copy_(src)) for _ in range(repeats))
    return 2 * src.numel() * 4 / best


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# ORT's pools and torch's OpenMP threads spin for a while after a call. A contender timed right after another
# runtime's call shares the cores with those spinning threads, and one timed after a pause first wakes its own sleeping
# threads: a generation sees neither (one runtime, steps back to back). So each contender waits this long (the others'
# threads go to sleep), runs once untimed (its own threads wake), then runs the timed call.
SETTLE_S = 0.25


def settled(run: Callable[[], float]) -> float:
    """One timed call of ``run`` as ``SETTLE_S`` describes: after the pause, an untimed call wakes this runtime's own
    threads, as the previous step of a generation leaves them; seconds of the call after it."""
    time.sleep(SETTLE_S)
    run()
    return run()


def _time_all(fns, x: torch.Tensor) -> float:
    start = time.perf_counter()
    for fn in fns:
        fn(x)
    return time.perf_counter() - start


def linear_sizes(spec: DecoderSpec) -> list[tuple[int, int]]:
    """The distinct (out, in) sizes of a decoder layer's linears."""
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    h, i = spec.hidden_size, spec.intermediate_size
    return sorted({(q, h), (kv, h), (h, q), (i, h), (h, i)})


def _copies(out_features: int, in_features: int) -> int:
    """Distinct copies of one size cycled so that together they pass 256 MB of float weights (no copy stays in cache)."""
    return max(2, -(-256 * 2**20 // (out_features * in_features * 4)))


def kernels_peak_bytes(sizes: list[tuple[int, int]]) -> int:
    """Peak of ``linear_kernels``: one size at a time, its float copies while packed (4 + 4 bytes) and quantized (1),
    the two 512 MiB bandwidth buffers and the libraries."""
    largest = max(_copies(o, i) * o * i for o, i in sizes)
    return 9 * largest + 2 * 512 * 2**20 + LIBRARIES_BYTES


def linear_kernels(
    shape: str = "qwen3-0.6b",
    rows: tuple[int, ...] = (1, 2, 4, 6, 8, 16),
    repeats: int = 5,
    progress: bool = True,
    int8_kernels: tuple[str, ...] = (),
) -> dict:
    """Each distinct linear size of ``shape``: float vs W8A8 kernel time per M, and both as a fraction of the bandwidth bound.

    Enough distinct weight copies are cycled (>= 256 MB of float weights) that every call
    streams its weights from memory, as in a real decode step. ``int8_kernels``: the W8A8 kernels to time, the first
    one reported in full, the others' times beside it (default: this CPU's default kernel).
    """
    from ..cpu.linears import float_linear, int8_linear
    from ..scheme import quantize_weight

    sizes = linear_sizes(synthetic_spec(shape))
    check_fits(kernels_peak_bytes(sizes), f"kernels --synthetic {shape}")
    float_kernel, dtype = default_float_kernel(), default_float_dtype("cpu")
    int8_kernel, *others = int8_kernels or (default_int8_kernel(),)
    bandwidth = memory_bandwidth()
    results = []
    generator = torch.Generator().manual_seed(0)
    for out_features, in_features in tqdm(sizes, desc="kernels", disable=not progress):
        copies = _copies(out_features, in_features)
        weights = [torch.randn(out_features, in_features, generator=generator) * 0.02 for _ in range(copies)]
        float_fns = [float_linear(w.to(dtype), None, float_kernel) for w in weights]
        quantized = [quantize_weight(w) for w in weights]
        del weights
        int8_fns = {k: [int8_linear(*q, None, None, k) for q in quantized] for k in (int8_kernel, *others)}
        del quantized
        for m in rows:
            x = torch.randn(m, in_features, generator=generator)
            timings = {}
            for name, fns in (("float", float_fns), *int8_fns.items()):
                rows_in = x.to(dtype) if name == "float" else x
                for fn in fns[:2]:
                    fn(rows_in)
                timings[name] = min(_time_all(fns, rows_in) for _ in range(repeats)) / copies
            float_bound = out_features * in_features * dtype.itemsize / bandwidth
            int8_bound = out_features * in_features / bandwidth
            results.append(
                {
                    "out_features": out_features,
                    "in_features": in_features,
                    "m": m,
                    "float_ms": 1000 * timings["float"],
                    "w8a8_ms": 1000 * timings[int8_kernel],
                    "speedup": timings["float"] / timings[int8_kernel],
                    "float_fraction_of_bound": float_bound / timings["float"],
                    "w8a8_fraction_of_bound": int8_bound / timings[int8_kernel],
                    "other_int8_ms": {k: 1000 * timings[k] for k in others},
                }
            )
        del float_fns, int8_fns
    return {
        "shape": shape,
        "float_kernel": float_kernel,
        "float_dtype": dtype_name(dtype),
        "int8_kernel": int8_kernel,
        "int8_kernel_label": int8_kernel_label(int8_kernel),
        "other_int8_kernels": others,
        "threads": torch.get_num_threads(),
        "bandwidth_gb_s": bandwidth / 1e9,
        "rows": results,
    }


def describe_linear_kernels(result: dict) -> str:
    others = result["other_int8_kernels"]
    lines = [
        f"linear kernels at {result['shape']} sizes; float {result['float_kernel']} in {result['float_dtype']}, "
        f"int8 {result['int8_kernel_label']}, "
        f"{result['threads']} threads; copy bandwidth {result['bandwidth_gb_s']:.1f} GB/s",
        f"{'out x in':>13} {'M':>3} {'float ms':>9} {'W8A8 ms':>8} {'speed-up':>8} {'float %bw':>9} {'W8A8 %bw':>8}"
        + "".join(f" {k + ' ms':>15}" for k in others),
    ]
    for r in result["rows"]:
        lines.append(
            f"{r['out_features']:>6}x{r['in_features']:<6} {r['m']:>3} {r['float_ms']:>9.3f} {r['w8a8_ms']:>8.3f} {r['speedup']:>7.2f}x "
            f"{100 * r['float_fraction_of_bound']:>8.0f}% {100 * r['w8a8_fraction_of_bound']:>7.0f}%"
            + "".join(f" {r['other_int8_ms'][k]:>15.3f}" for k in others)
        )
    return "\n".join(lines)
