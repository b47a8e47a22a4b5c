"""Benchmarks. Every speed claim in the docs comes from a function here, reported as a ratio measured in one run.

``verify_step``: the cost of one speculative verify forward (k+1 tokens on a warm
KV cache), float vs W8A8, interleaved pair by pair so machine drift cancels, next
to the ideal ratio of weight bytes each step must read.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch
from tqdm import tqdm

from .kernels import default_float_kernel, default_int8_kernel
from .model import Decoder
from .synthetic import synthetic_decoders


def weight_bytes(decoder: Decoder) -> int:
    """Bytes of weights one forward step reads (linears and lm_head; the embedding lookup is negligible)."""
    total = 0
    for module in [m for _, m in decoder.linears()] + [decoder.lm_head]:
        total += module.weight.numel() * module.weight.element_size()
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
    threads: int
    float_ms: float  # medians
    w8a8_ms: float
    ratio: float  # median over pairs of float time / W8A8 time
    ratio_spread: tuple[float, float]  # min, max over pairs
    ideal_ratio: float  # float weight bytes / W8A8 weight bytes
    fraction_of_ideal: float

    def to_dict(self) -> dict:
        return asdict(self)


def _time_step(decoder: Decoder, cache, context: int, ids: torch.Tensor) -> float:
    cache.truncate(context)
    start = time.perf_counter()
    decoder(ids, cache)
    return time.perf_counter() - start


def verify_step(
    shape: str = "qwen3-0.6b",
    tokens: int = 6,
    context: int = 128,
    repeats: int = 20,
    float_kernel: str | None = None,
    int8_kernel: str | None = None,
    progress: bool = True,
) -> VerifyStepResult:
    """Synthetic weights of a published shape; W8A8 quantized without calibration (timing only)."""
    float_kernel = float_kernel or default_float_kernel()
    int8_kernel = int8_kernel or default_int8_kernel()
    float_model, quant_model = synthetic_decoders(shape)
    float_model.prepare(float_kernel, int8_kernel)
    quant_model.prepare(float_kernel, int8_kernel)
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, float_model.spec.vocab_size, (context,), generator=generator)
    ids = torch.randint(0, float_model.spec.vocab_size, (tokens,), generator=generator)
    caches = []
    for model in (float_model, quant_model):
        cache = model.new_cache(context + tokens)
        model(prompt, cache)
        _time_step(model, cache, context, ids)  # warm-up
        caches.append(cache)
    float_times, quant_times = [], []
    for _ in tqdm(range(repeats), desc=f"verify step {shape}", disable=not progress):
        float_times.append(_time_step(float_model, caches[0], context, ids))
        quant_times.append(_time_step(quant_model, caches[1], context, ids))
    ratios = [f / q for f, q in zip(float_times, quant_times)]
    ideal = weight_bytes(float_model) / weight_bytes(quant_model)
    ratio = statistics.median(ratios)
    return VerifyStepResult(
        shape=shape,
        tokens=tokens,
        context=context,
        repeats=repeats,
        float_kernel=float_kernel,
        int8_kernel=int8_kernel,
        threads=torch.get_num_threads(),
        float_ms=1000 * statistics.median(float_times),
        w8a8_ms=1000 * statistics.median(quant_times),
        ratio=ratio,
        ratio_spread=(min(ratios), max(ratios)),
        ideal_ratio=ideal,
        fraction_of_ideal=ratio / ideal,
    )
