"""The demo's end-to-end timing: each mode (an engine decoding with n-gram drafting) on the same prompts, taking turns."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence

from ..engine import Engine, GenerationStats

NUM_DRAFT, NGRAM = 5, (1, 3)


def _run(engine: Engine, ids: list[int], max_new_tokens: int) -> GenerationStats:
    options = dict(max_new_tokens=max_new_tokens, draft="ngram", num_draft=NUM_DRAFT, ngram_min=NGRAM[0], ngram_max=NGRAM[1])
    return engine.generate(ids, **options).stats


def timed_runs(engines: Mapping[str, Engine], encoded: Sequence[list[int]], max_new_tokens: int) -> dict[str, list[GenerationStats]]:
    """Each mode's generation of every prompt, the modes taking turns prompt by prompt (a different one first each time)."""
    modes = list(engines)
    for engine in engines.values():  # one-time costs (weight packing, allocator) kept out of the figures
        _run(engine, encoded[0], 4)
    runs: dict[str, list[GenerationStats]] = {m: [] for m in modes}
    for i, ids in enumerate(encoded):
        for mode in modes[i % len(modes) :] + modes[: i % len(modes)]:
            runs[mode].append(_run(engines[mode], ids, max_new_tokens))
    return runs


def figures(runs: Mapping[str, Sequence[GenerationStats]], float_modes: Sequence[str]) -> dict[str, dict]:
    """Per mode: tokens/s, acceptance length, verify-step ms, and ``vs_best_float``: the median per-prompt ratio to the
    fastest of ``float_modes``."""
    count = len(next(iter(runs.values())))
    best = [max(runs[m][i].tokens_per_s for m in float_modes) for i in range(count)]
    result = {}
    for mode, stats in runs.items():
        speeds = [s.tokens_per_s for s in stats]
        result[mode] = {
            "tokens_per_s": statistics.median(speeds),
            "tokens_per_s_min": min(speeds),
            "tokens_per_s_max": max(speeds),
            "acceptance_length": statistics.mean(s.acceptance_length for s in stats),
            "acceptance_lengths": [s.acceptance_length for s in stats],
            "verify_step_ms": 1000 * sum(s.verify_s for s in stats) / max(1, sum(s.verify_steps for s in stats)),
            "vs_best_float": statistics.median(speed / b for speed, b in zip(speeds, best)),
        }
    return result
