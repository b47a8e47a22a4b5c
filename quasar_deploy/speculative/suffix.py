"""Suffix drafting (SuffixDecoding, Oliaro et al. 2024): continue the text the way it most often continued after the
longest context it shares with the past, for as many tokens as those counts make likely.

A draft stops below ``min_prob``, or after ``SPEC_FACTOR`` tokens per matched token (a suffix tree as vLLM's)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import QuasarError
from .acceptance import Sampler
from .drafters import NO_DRAFT, Draft
from .suffix_tree import DEPTH, Node, anchor, best_draft

if TYPE_CHECKING:
    from .drafters import DrafterContext
    from .output_cache import OutputCache

MIN_PROB = 0.1  # vLLM's min_token_prob: stop the draft where the estimated chance that all of it is kept falls below
SPEC_FACTOR = 2  # the most tokens drafted per token of matched context (vLLM's max_spec_factor)


def check_suffix_options(min_prob: float) -> None:
    if isinstance(min_prob, bool) or not isinstance(min_prob, int | float) or not 0 <= min_prob < 1:
        raise QuasarError(f"suffix_min_prob must be a number in [0, 1), got {min_prob!r}")


class SuffixDrafter:
    """Indexes ``tokens`` as they grow and proposes the walk that expects the most kept tokens, here or in ``cache``."""

    def __init__(self, min_prob: float = MIN_PROB, depth: int = DEPTH, spec_factor: int = SPEC_FACTOR, cache: OutputCache | None = None):
        check_suffix_options(min_prob)
        self.min_prob, self.depth, self.spec_factor, self.cache = min_prob, depth, spec_factor, cache
        self._root = Node()
        self._active: list[Node] = []  # the nodes of the suffixes of lengths 1..depth of the indexed text
        self._indexed = 0

    def _append(self, token: int) -> None:
        extended: list[Node] = []
        for parent in [self._root, *self._active[: self.depth - 1]]:
            child = parent.children.get(token)
            if child is None:
                child = parent.children[token] = Node()
            child.count += 1
            parent.continued += 1
            if parent.best is None or child.count >= parent.best[1].count:  # of equal counts, the latest seen is best
                parent.best = (token, child)
            extended.append(child)
        self._active = extended
        self._indexed += 1

    def propose(self, tokens: Sequence[int], k: int, sampler: Sampler) -> Draft:
        for token in tokens[self._indexed :]:
            self._append(token)
        tail = tokens[-self.depth :]  # a walk that runs out goes on from the longest context of text and draft
        matched = self._active[: self.depth - 1]
        best, expected = best_draft(
            ((length, matched[length - 1]) for length in range(len(matched), 0, -1)),
            k,
            self.min_prob,
            self.spec_factor,
            lambda draft: anchor(self._root, [*tail, *draft], self.depth),
        )
        if self.cache is not None:
            shared, shared_expected = self.cache.propose(tokens, k, self.min_prob, self.spec_factor)
            if shared_expected > expected:
                best = shared
        return Draft(best) if best else NO_DRAFT


def suffix_drafter(context: DrafterContext, options: Mapping[str, Any]) -> SuffixDrafter:
    """The registry's factory for "suffix": its probability floor, and the engine's ``output_cache`` if any."""
    return SuffixDrafter(options["suffix_min_prob"], cache=context.output_cache)
