"""Benchmarks. Every speed claim in the docs comes from a function here, reported as a ratio measured in one run.

``verify_step``: one verify forward, float vs W8A8 interleaved so that machine drift cancels, beside the ideal ratio."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from tqdm import tqdm

from ..backends.torch_backend import bind_cpu_attention
from ..cpu.choice import default_int8_kernel
from ..cpu.linears import default_float_dtype, default_float_kernel, dtype_name, float_linear, int8_kernel_label, int8_linear
from ..cpu.machine import cpu_model
from ..decoder_spec import DecoderSpec
from ..model import Decoder
from ..scheme import quantize_weight
from .memory import check_fits
from .synthetic import LIBRARIES_BYTES, RandomTensors, engines_peak_bytes, step_read_bytes, synthetic_decoders, synthetic_spec


def weight_bytes(decoder: Decoder) -> int:
    """Bytes of weights one forward step reads: linears and lm_head as their kernels read them (``Linear.read_itemsize``)."""
    modules = [m for _, m in decoder.linears()] + [decoder.lm_head]
    return sum(m.weight.numel() * m.read_itemsize + (0 if m.weight_scale is None else 4 * m.weight_scale.numel()) for m in modules)


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
    int8_kernel: str | None = None,
    progress: bool = True,
    int8_lm_head: bool = False,
    float_dtypes: tuple[torch.dtype, ...] | None = None,
) -> VerifyStepResult:
    """Synthetic weights of a published shape: every float contender and the W8A8 twin take turns; ratios against the fastest."""
    float_kernel = default_float_kernel()
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
    ideal = weight_bytes(next(m for d, m in models.items() if dtype_name(d) == best)) / weight_bytes(quant_model)
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
    return 2 * src.numel() * 4 / min(timed(lambda: dst.copy_(src)) for _ in range(repeats))


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# ORT's and OpenMP's threads spin a while after a call and wake slowly after a pause; a generation sees neither, so a
# contender waits this long (the others' threads sleep), runs once untimed (its own wake), then is timed
SETTLE_S = 0.25


def settled(run: Callable[[], float]) -> float:
    """Seconds of one call of ``run`` settled as ``SETTLE_S`` describes."""
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
    """Peak of ``linear_kernels``: the largest size's copies packed (4 + 4 bytes) and quantized (1), bandwidth buffers, libraries."""
    return 9 * max(_copies(o, i) * o * i for o, i in sizes) + 2 * 512 * 2**20 + LIBRARIES_BYTES


def linear_kernels(
    shape: str = "qwen3-0.6b",
    rows: tuple[int, ...] = (1, 2, 4, 6, 8, 16),
    repeats: int = 5,
    progress: bool = True,
    int8_kernels: tuple[str, ...] = (),
) -> dict:
    """Each linear size of ``shape``: float vs W8A8 time per M against the bandwidth bound, weights streamed from memory."""
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
