"""Suffix drafting (SuffixDecoding, Oliaro et al. 2024): continue the text the way it most often continued after the
longest context it shares with the past, for as many tokens as those counts make likely.

Model-free like n-gram lookup, but where n-gram copies what followed the latest occurrence of the last 1-3 tokens,
this matches contexts of up to ``depth`` tokens and picks the most frequent continuation, so a draft follows the
text's habits rather than its last accident, and its length varies, up to k (16 by default, registry): it stops where
the counts say the next token is unlikely (the running product of the picks' frequencies falls below ``min_prob``),
and after ``SPEC_FACTOR`` tokens per token of the context it matched, since a long match predicts a long repeat and a
short one does not (counts of one say "certain" after any match), so rows likely to be rejected are not verified. The
index is a suffix tree bounded in depth, as vLLM's: a trie of every substring of at most ``depth`` tokens of the prompt
and the generated text, each node counting its occurrences and keeping its most frequent child. Appending a token extends the ``depth``
suffixes that end at the text's end (O(depth) per token, however long the text grows); a proposal walks at most
``depth`` match lengths and ``k`` picks from each.
"""

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
# the most tokens drafted per token of matched context (vLLM's max_spec_factor, 1 there). 2 kept the most tokens per
# unit of verify time on the Spec-Bench sets with the inflated demo (bench e2e records e2e-inflated-demo-suffix-*)
SPEC_FACTOR = 2


def check_suffix_options(min_prob: float) -> None:
    if isinstance(min_prob, bool) or not isinstance(min_prob, int | float) or not 0 <= min_prob < 1:
        raise QuasarError(f"suffix_min_prob must be a number in [0, 1), got {min_prob!r}")


class SuffixDrafter:
    """Indexes ``tokens`` as they grow (only appended between calls, as the loop promises) and proposes from the match
    length whose greedy walk down the counts expects the most kept tokens; with a ``cache`` of earlier generations'
    outputs (``output_cache``, opt-in), the walk there too where it expects more."""

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
            # only this child's count changed, and it is the latest seen: it becomes the best at a tie
            if parent.best is None or child.count >= parent.best[1].count:
                parent.best = (token, child)
            extended.append(child)
        self._active = extended
        self._indexed += 1

    def propose(self, tokens: Sequence[int], k: int, sampler: Sampler) -> Draft:
        for token in tokens[self._indexed :]:
            self._append(token)
        # where a walk runs out (the tree's depth, or the text's end: a repeating pattern's latest occurrence runs into
        # the text being drafted), it goes on from the longest context of the text and the draft so far, as n-gram
        # lookup copies with overlap, so a repeating pattern yields a full k
        tail = tokens[-self.depth :]
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
    """The registry's factory for "suffix": model-free, so it needs only its probability floor, and the engine's cache
    of earlier outputs where one was set up (``Engine.output_cache``)."""
    return SuffixDrafter(options["suffix_min_prob"], cache=context.output_cache)
