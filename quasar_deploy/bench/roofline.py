"""One generation on the cpu backend set against the memory-bandwidth bound: a verify step must read every weight
once, so it cannot beat (bytes per step) / (copy bandwidth), both measured in the same run on the real model."""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ..api import load
from ..memory import kv_cache_bytes, resident
from .micro import memory_bandwidth, weight_bytes


@dataclass
class RooflineResult:
    model: str
    draft: str
    new_tokens: int
    tokens_per_s: float
    decode_tokens_per_s: float
    acceptance_length: float
    verify_step_ms: float  # mean over the generation's verify steps
    bytes_per_step: int  # weights (int8 + scales + the lm_head, float unless int8) and the KV cache at the final length
    bandwidth_gb_s: float  # copy bandwidth (read + write), measured before the generation
    bound_step_ms: float  # bytes_per_step / bandwidth
    bound_tokens_per_s: float  # acceptance_length / bound_step
    fraction_of_bound: float  # bound_step_ms / verify_step_ms
    load_s: float
    resident_mib: dict
    load_average: float

    def to_dict(self) -> dict:
        return asdict(self)


def roofline(path: str | Path, prompt: str, max_new_tokens: int = 32, draft: str = "ngram", num_draft: int = 5) -> RooflineResult:
    """Load ``path`` on the cpu backend, measure the copy bandwidth, generate greedily, and compare."""
    began = time.perf_counter()
    engine = load(path, backend="cpu")
    load_s = time.perf_counter() - began
    bandwidth = memory_bandwidth()
    result = engine.generate(prompt, max_new_tokens=max_new_tokens, draft=draft, num_draft=num_draft)
    stats, decoder = result.stats, engine.lm.decoder
    step_bytes = weight_bytes(decoder) + kv_cache_bytes(decoder.spec, result.prompt_tokens + len(result.tokens), decoder.dtype.itemsize)
    step_s = stats.verify_s / stats.verify_steps if stats.verify_steps else float("nan")
    bound_s = step_bytes / bandwidth
    return RooflineResult(
        model=str(path),
        draft=draft,
        new_tokens=stats.new_tokens,
        tokens_per_s=stats.tokens_per_s,
        decode_tokens_per_s=stats.decode_tokens_per_s,
        acceptance_length=stats.acceptance_length,
        verify_step_ms=1e3 * step_s,
        bytes_per_step=step_bytes,
        bandwidth_gb_s=bandwidth / 1e9,
        bound_step_ms=1e3 * bound_s,
        bound_tokens_per_s=stats.acceptance_length / bound_s,
        fraction_of_bound=bound_s / step_s,
        load_s=load_s,
        resident_mib=resident(),
        load_average=os.getloadavg()[0],
    )


def describe_roofline(r: RooflineResult) -> str:
    return "\n".join(
        [
            f"{r.model}: {r.new_tokens} tokens, {r.draft} drafting, cpu backend (load {r.load_s:.1f} s)",
            f"tokens/s           {r.tokens_per_s:9.2f} (decode {r.decode_tokens_per_s:.2f}; acceptance length {r.acceptance_length:.2f})",
            f"verify step        {r.verify_step_ms:9.1f} ms (mean)",
            f"bytes per step     {r.bytes_per_step / 1e9:9.2f} GB / copy bandwidth {r.bandwidth_gb_s:.1f} GB/s",
            f"bound              {r.bound_step_ms:9.1f} ms per step = {r.bound_tokens_per_s:.2f} tokens/s at this acceptance",
            f"reached            {100 * r.fraction_of_bound:8.0f}% of the bound",
            f"resident           {r.resident_mib.get('vmrss_mib', 0):,.0f} MiB (anonymous {r.resident_mib.get('rssanon_mib', 0):,.0f} MiB);"
            f" load average {r.load_average:.1f}",
        ]
    )
