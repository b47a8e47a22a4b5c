"""The speculative loop, one for every drafter and every backend: draft, verify once, accept, roll back.

The prefill of the whole prompt gives the first new token, exactly as the
verifier's own decode does (so a backend may prefill with other numerics than it
verifies with). From then on the verifier's cache holds every token of the
sequence but the last, which is pending. Each step feeds the pending token and k
drafted tokens in one verify forward (k+1 positions), keeps the cache up to the
accepted prefix, and the verifier's own next token (corrected or bonus) becomes
the new pending one.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass

from ..errors import QuasarError
from .acceptance import Sampler, accept
from .causal_lm import CausalLM
from .drafters import NO_DRAFT, Drafter


@dataclass
class LoopStats:
    """Counters the loop fills as it runs; times are seconds of wall clock.

    ``verify_steps`` counts verify forwards, not the prefill (which emits the first
    token); each step emits its ``accepted`` drafted tokens plus one of the verifier's.
    """

    verify_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0

    @property
    def acceptance_length(self) -> float:
        """Mean tokens emitted per verify step: 1.0 without drafting, up to k+1."""
        return 1.0 + self.accepted / self.verify_steps if self.verify_steps else 1.0


def speculate(
    lm: CausalLM,
    drafter: Drafter,
    prompt: Sequence[int],
    sampler: Sampler,
    num_draft: int,
    max_new_tokens: int,
    stop_ids: Collection[int] = (),
    stats: LoopStats | None = None,
) -> Iterator[list[int]]:
    """An iterator over the new tokens each verify step emits, until ``max_new_tokens``, a stop id or the context window.

    Bad arguments raise here, before any work. A stop id is emitted, then
    generation ends. Stop early by closing the iterator; the verifier's cache then
    holds a consistent prefix.
    """
    if not prompt:
        raise QuasarError("the prompt is empty")
    if len(prompt) >= lm.max_length:
        raise QuasarError(f"the prompt is {len(prompt)} tokens; the context window is {lm.max_length}, which leaves no room to generate")
    if isinstance(num_draft, bool) or not isinstance(num_draft, int) or num_draft < 0:
        raise QuasarError(f"the number of draft tokens must be an integer >= 0, got {num_draft!r}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise QuasarError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    return _steps(lm, drafter, list(prompt), sampler, num_draft, max_new_tokens, stop_ids, stats if stats is not None else LoopStats())


def _steps(
    lm: CausalLM,
    drafter: Drafter,
    tokens: list[int],
    sampler: Sampler,
    num_draft: int,
    max_new_tokens: int,
    stop_ids: Collection[int],
    stats: LoopStats,
) -> Iterator[list[int]]:
    began = time.perf_counter()
    verdict = accept(lm.prefill(tokens)[None], [], None, sampler)
    stats.prefill_s += time.perf_counter() - began
    emitted = 0
    while True:
        new = verdict.tokens
        stop_at = next((i for i, t in enumerate(new) if t in stop_ids), None)
        if stop_at is not None:
            new = new[: stop_at + 1]
        tokens.extend(new)
        emitted += len(new)
        yield new
        room = min(max_new_tokens - emitted, lm.max_length - len(tokens))
        if stop_at is not None or room <= 0:
            return
        # A step emits at most k+1 tokens: never draft past the budget or the context window.
        k = min(num_draft, room - 1)
        began = time.perf_counter()
        draft = drafter.propose(tokens, k, sampler) if k > 0 else NO_DRAFT
        drafted = draft.tokens[:k]
        probs = draft.probs[:k] if draft.probs is not None else None
        checked = time.perf_counter()
        stats.draft_s += checked - began
        verdict = accept(lm.verify([tokens[-1], *drafted]), drafted, probs, sampler)
        lm.truncate(len(tokens) + verdict.accepted)
        stats.verify_s += time.perf_counter() - checked
        stats.verify_steps += 1
        stats.drafted += len(drafted)
        stats.accepted += verdict.accepted
