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

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import QuasarError
from .acceptance import Sampler
from .drafters import NO_DRAFT, Draft

if TYPE_CHECKING:
    from .output_cache import OutputCache
    from .registry import DrafterContext

# the longest substring indexed, so the longest context matched is 15 tokens (n-gram lookup's is 3); each appended token
# costs this many node updates (about 3 us each in CPython), so a deeper tree costs more than longer contexts win.
# vLLM's suffix tree is bounded the same way (24 by default)
DEPTH = 16
MIN_PROB = 0.1  # vLLM's min_token_prob: stop the draft where the estimated chance that all of it is kept falls below
# the most tokens drafted per token of matched context (vLLM's max_spec_factor, 1 there). 2 kept the most tokens per
# unit of verify time on the Spec-Bench sets with the inflated demo (bench e2e records e2e-inflated-demo-suffix-*)
SPEC_FACTOR = 2


class _Node:
    """One substring: how often it occurred (``count``), how often something followed it (``continued``, the sum of
    its children's counts), and its most frequent next token (``best``; of equals, the one seen latest, as n-gram
    lookup prefers recent text), kept up to date as counts grow so a draft's pick is O(1)."""

    __slots__ = ("best", "children", "continued", "count")

    def __init__(self) -> None:
        self.children: dict[int, _Node] = {}
        self.count = 0
        self.continued = 0
        self.best: tuple[int, _Node] | None = None


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
        self._root = _Node()
        self._active: list[_Node] = []  # the nodes of the suffixes of lengths 1..depth of the indexed text
        self._indexed = 0

    def _append(self, token: int) -> None:
        extended: list[_Node] = []
        for parent in [self._root, *self._active[: self.depth - 1]]:
            child = parent.children.get(token)
            if child is None:
                child = parent.children[token] = _Node()
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


def node_of(root: _Node, text: Sequence[int]) -> _Node | None:
    """The node of ``text`` under ``root`` (``text`` occurred), or None."""
    node: _Node | None = root
    for token in text:
        node = node.children.get(token)
        if node is None:
            return None
    return node


def anchor(root: _Node, text: Sequence[int], depth: int) -> _Node | None:
    """The node of the longest suffix of ``text`` (at most depth - 1 tokens) that something followed, or None."""
    for length in range(min(depth - 1, len(text)), 0, -1):
        node = node_of(root, text[len(text) - length :])
        if node is not None and node.best is not None:
            return node
    return None


def walk(node: _Node, k: int, min_prob: float, resume: Callable[[list[int]], _Node | None]) -> tuple[list[int], float]:
    """Up to ``k`` most frequent next tokens from ``node`` while their running probability stays at or above
    ``min_prob``, and the expected number of them kept (the sum of those running probabilities). Where the counts run
    out, ``resume(draft so far)`` gives the node to go on from, or None to stop."""
    draft: list[int] = []
    chance, expected = 1.0, 0.0
    while len(draft) < k:
        if node.best is None:
            resumed = resume(draft)
            if resumed is None:
                break
            node = resumed
        token, child = node.best
        chance *= child.count / node.continued
        if chance < min_prob:
            break
        draft.append(token)
        expected += chance
        node = child
    return draft, expected


def best_draft(
    matches: Iterable[tuple[int, _Node]],
    k: int,
    min_prob: float,
    spec_factor: int,
    resume: Callable[[list[int]], _Node | None],
) -> tuple[list[int], float]:
    """Of the walks from each matched context (its length and node, the longest first: the most specific context wins
    ties), the one that expects the most kept tokens, each at most ``spec_factor`` tokens per matched token; and what it
    expects. A draft as long as its match allows, all certain, cannot be beaten: shorter matches allow less."""
    best: list[int] = []
    best_expected = 0.0
    for length, node in matches:
        if node.best is None:  # no earlier occurrence with a token after it
            continue
        most = min(k, spec_factor * length)
        draft, expected = walk(node, most, min_prob, resume)
        if expected > best_expected:
            best, best_expected = draft, expected
            if expected >= most:
                break
    return best, best_expected


def suffix_drafter(context: DrafterContext, options: Mapping[str, Any]) -> SuffixDrafter:
    """The registry's factory for "suffix": model-free, so it needs only its probability floor, and the engine's cache
    of earlier outputs where one was set up (``Engine.output_cache``)."""
    return SuffixDrafter(options["suffix_min_prob"], cache=context.output_cache)
