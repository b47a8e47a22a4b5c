"""The first generation after ``load`` against the next ones: ``quasar-deploy bench first-call``.

``load`` ends with a warm-up so that the first ``generate`` runs at the steady state (target: 90% of the others' median)."""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ..api import load
from ..backends.registry import draft_needs
from ..calibration.data import BUILTIN
from ..engine import GenerationResult
from ..errors import QuasarError
from .e2e import read_prompts


@dataclass(frozen=True)
class FirstCallResult:
    """``decode_tokens_per_s``: one entry per call (a round over the prompts), in order; ``load_s`` includes the warm-up."""

    path: str
    backend: str
    draft: str
    num_draft: int
    max_new_tokens: int
    prompts: int
    load_s: float
    decode_tokens_per_s: list[float]
    new_tokens: list[int]

    @property
    def first_vs_rest(self) -> float:
        """The first call's decode speed over the median of the later calls'."""
        return self.decode_tokens_per_s[0] / statistics.median(self.decode_tokens_per_s[1:])

    def to_dict(self) -> dict:
        return {**asdict(self), "first_vs_rest": self.first_vs_rest}


def decode_rate(results: list[GenerationResult]) -> float:
    """Tokens after the first of each generation per second after its prefill, over all of ``results`` together."""
    tokens = sum(max(r.stats.new_tokens - 1, 0) for r in results)
    seconds = sum(r.stats.wall_s - r.stats.prefill_s for r in results)
    return tokens / seconds if seconds > 0 else 0.0


def first_call(
    path: str | Path,
    backend: str = "auto",
    draft: str = "ngram",
    num_draft: int = 5,
    max_new_tokens: int = 128,
    calls: int = 3,
    prompts: str | Path | None = None,
    limit: int = 1,
) -> FirstCallResult:
    """Load ``path`` once, then generate the first ``limit`` of ``prompts`` ``calls`` times, greedy: each round's decode speed."""
    if calls < 2:
        raise QuasarError("--calls must be at least 2: the first call is compared with the later ones")
    texts = read_prompts(prompts or BUILTIN["prompts"], limit)
    needs = draft_needs(draft)
    start = time.perf_counter()
    engine = load(path, backend=backend, needs=needs)
    load_s = time.perf_counter() - start
    rates, tokens = [], []
    for _ in range(calls):
        results = [engine.generate(text, max_new_tokens=max_new_tokens, draft=draft, num_draft=num_draft) for text in texts]
        rates.append(decode_rate(results))
        tokens.append(sum(r.stats.new_tokens for r in results))
    return FirstCallResult(str(path), engine.backend, draft, num_draft, max_new_tokens, len(texts), load_s, rates, tokens)


def describe_first_call(result: FirstCallResult) -> str:
    """The report: the load, each call's decode speed, and the first call against the others."""
    lines = [
        f"{result.path} on {result.backend}, --draft {result.draft} -k {result.num_draft}, {result.max_new_tokens} new tokens, "
        f"{result.prompts} prompt(s) per call",
        f"  load (warm-up included): {result.load_s:.1f} s",
    ]
    for i, (rate, tokens) in enumerate(zip(result.decode_tokens_per_s, result.new_tokens), start=1):
        lines.append(f"  call {i}: {rate:8.1f} decode tok/s ({tokens} new tokens)")
    lines.append(f"  first call at {100 * result.first_vs_rest:.0f}% of the median of the later calls (target: at least 90%)")
    return "\n".join(lines)
