"""The speculative loop, one for every drafter and every backend: draft, verify once, accept, roll back.

The cache holds every token but the last, pending one, which each step verifies with k drafts in one forward."""

from __future__ import annotations

import time
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass

import torch

from ..errors import QuasarError
from .acceptance import Sampler, accept
from .causal_lm import CausalLM
from .draft_length import DraftLength
from .drafters import NO_DRAFT, Drafter


@dataclass
class LoopStats:
    """Counters the loop fills as it runs; times are seconds of wall clock. ``verify_steps`` leaves out the prefill."""

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


class Speculation:
    """One sequence's speculative decoding as phases, so a caller can verify many sequences' blocks in one forward:
    ``prefill``, then ``draft``, the block's logits and ``settle`` until ``finished``; ``adaptive_k``: see ``draft_length``."""

    def __init__(
        self,
        lm: CausalLM,
        drafter: Drafter,
        prompt: Sequence[int],
        sampler: Sampler,
        num_draft: int,
        max_new_tokens: int,
        stop_ids: Collection[int] = (),
        stats: LoopStats | None = None,
        adaptive_k: bool = False,
    ):
        if not prompt:
            raise QuasarError("the prompt is empty")
        if len(prompt) >= lm.max_length:
            window = lm.max_length
            raise QuasarError(f"the prompt is {len(prompt)} tokens; the context window is {window}, which leaves no room to generate")
        if isinstance(num_draft, bool) or not isinstance(num_draft, int) or num_draft < 0:
            raise QuasarError(f"the number of draft tokens must be an integer >= 0, got {num_draft!r}")
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise QuasarError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        self.lm, self.drafter, self.sampler = lm, drafter, sampler
        self.num_draft, self.max_new_tokens, self.stop_ids = num_draft, max_new_tokens, stop_ids
        self.draft_length = DraftLength(num_draft, adaptive_k)
        self.stats = stats if stats is not None else LoopStats()
        self.tokens, self.emitted, self.finished = list(prompt), 0, False
        self._drafted: list[int] = []
        self._probs: torch.Tensor | None = None

    def steps(self) -> Iterator[list[int]]:
        """The new tokens each verify step emits, until ``max_new_tokens``, a stop id (emitted) or the context window."""
        yield self.prefill()
        while not self.finished:
            yield self.step()

    def prefill(self) -> list[int]:
        """Cache the prompt; the first new token(s)."""
        began = time.perf_counter()
        return self.settle_prefill(self.lm.prefill(self.tokens), began)

    def settle_prefill(self, logits: torch.Tensor, prefill_began: float) -> list[int]:
        """The first new token(s) from the prompt's last ``logits`` [vocab], from a forward begun at ``prefill_began``."""
        verdict = accept(logits[None], [], None, self.sampler)
        self.stats.prefill_s += time.perf_counter() - prefill_began
        return self._emit(verdict.tokens)

    def draft(self) -> list[int]:
        """The block the verifier must run next: the pending token and the drafted ones."""
        room = min(self.max_new_tokens - self.emitted, self.lm.max_length - len(self.tokens))
        k = min(self.draft_length.k, room - 1)  # a step emits at most k+1 tokens
        began = time.perf_counter()
        draft = self.drafter.propose(self.tokens, k, self.sampler) if k > 0 else NO_DRAFT
        self._drafted, self._probs = draft.tokens, draft.probs
        self.stats.draft_s += time.perf_counter() - began
        return self.trim(k)

    def trim(self, keep: int) -> list[int]:
        """The block of ``draft`` with only its first ``keep`` drafted tokens (a server's row budget): lossless."""
        self._drafted = self._drafted[:keep]
        self._probs = self._probs[:keep] if self._probs is not None else None
        return [self.tokens[-1], *self._drafted]

    def settle(self, logits: torch.Tensor, verify_began: float) -> list[int]:
        """The tokens emitted by the drafted block's ``logits`` (a forward begun at ``verify_began``); rolls the cache back."""
        verdict = accept(logits, self._drafted, self._probs, self.sampler)
        self.lm.truncate(len(self.tokens) + verdict.accepted)
        self.stats.verify_s += time.perf_counter() - verify_began
        self.stats.verify_steps += 1
        self.stats.drafted += len(self._drafted)
        self.stats.accepted += verdict.accepted
        self.draft_length.observe(len(self._drafted), verdict.accepted)
        return self._emit(verdict.tokens)

    def step(self) -> list[int]:
        """One whole verify step on this sequence's own verifier."""
        block = self.draft()
        began = time.perf_counter()
        return self.settle(self.lm.verify(block), began)

    def _emit(self, new: list[int]) -> list[int]:
        if (stop_at := next((i for i, t in enumerate(new) if t in self.stop_ids), None)) is not None:
            new = new[: stop_at + 1]
        self.tokens.extend(new)
        self.emitted += len(new)
        room = min(self.max_new_tokens - self.emitted, self.lm.max_length - len(self.tokens))
        self.finished = stop_at is not None or room <= 0
        return new
