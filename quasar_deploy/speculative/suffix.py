"""Suffix drafting (SuffixDecoding, Oliaro et al. 2024): continue the text the way it most often continued after the
longest context it shares with the past, for as many tokens as those counts make likely.

Model-free like n-gram lookup, but where n-gram copies what followed the latest occurrence of the last 1-3 tokens,
this matches contexts of up to ``depth`` tokens and picks the most frequent continuation, so a draft follows the text's
habits rather than its last accident, and its length varies: it stops where the counts say the next token is
unlikely (the running product of the picks' frequencies falls below ``min_prob``), so rows likely to be rejected are
not verified. The index is a suffix tree bounded in depth, as vLLM's: a trie of every substring of at most ``depth``
tokens of the prompt and the generated text, each node counting its occurrences and keeping its most frequent child.
Appending a token extends the ``depth`` suffixes that end at the text's end (O(depth) per token, however long the
text grows); a proposal walks at most ``depth`` match lengths and ``k`` picks from each.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import QuasarError
from .acceptance import Sampler
from .drafters import NO_DRAFT, Draft

if TYPE_CHECKING:
    from .registry import DrafterContext

# the longest substring indexed, so the longest context matched is 15 tokens (n-gram lookup's is 3); each appended token
# costs this many node updates (about 3 us each in CPython), so a deeper tree costs more than longer contexts win.
# vLLM's suffix tree is bounded the same way (24 by default)
DEPTH = 16
MIN_PROB = 0.1  # vLLM's min_token_prob: stop the draft where the estimated chance that all of it is kept falls below


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
    length whose greedy walk down the counts expects the most kept tokens."""

    def __init__(self, min_prob: float = MIN_PROB, depth: int = DEPTH):
        check_suffix_options(min_prob)
        self.min_prob, self.depth = min_prob, depth
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

    def _anchor(self, text: Sequence[int]) -> _Node | None:
        """The node of the longest suffix of ``text`` (at most depth - 1 tokens) that something followed, or None."""
        for length in range(min(self.depth - 1, len(text)), 0, -1):
            node: _Node | None = self._root
            for token in text[len(text) - length :]:
                node = node.children.get(token)
                if node is None:
                    break
            if node is not None and node.best is not None:
                return node
        return None

    def _walk(self, node: _Node, tokens: Sequence[int], k: int) -> tuple[list[int], float]:
        """Up to ``k`` most frequent next tokens from ``node`` while their running probability stays at or above
        ``min_prob``, and the expected number of them kept (the sum of those running probabilities).

        Where the walk runs out (the tree's depth, or the text's end: a repeating pattern's latest occurrence runs
        into the text being drafted), it goes on from the longest context of the text and the draft so far, as n-gram
        lookup copies with overlap, so a repeating pattern yields a full k."""
        draft: list[int] = []
        chance, expected = 1.0, 0.0
        while len(draft) < k:
            if node.best is None:
                anchored = self._anchor([*tokens[-self.depth :], *draft])
                if anchored is None:
                    break
                node = anchored
            token, child = node.best
            chance *= child.count / node.continued
            if chance < self.min_prob:
                break
            draft.append(token)
            expected += chance
            node = child
        return draft, expected

    def propose(self, tokens: Sequence[int], k: int, sampler: Sampler) -> Draft:
        for token in tokens[self._indexed :]:
            self._append(token)
        best: list[int] = []
        best_expected = 0.0
        # the longest match first (the most specific context; it wins ties); depth - 1 at most, so its node can have
        # children. A draft of k tokens all certain cannot be beaten.
        for node in reversed(self._active[: self.depth - 1]):
            if node.best is None:  # no earlier occurrence with a token after it
                continue
            draft, expected = self._walk(node, tokens, k)
            if expected > best_expected:
                best, best_expected = draft, expected
                if expected >= k:
                    break
        return Draft(best) if best else NO_DRAFT


def suffix_drafter(context: DrafterContext, options: Mapping[str, Any]) -> SuffixDrafter:
    """The registry's factory for "suffix": model-free, so it needs only its probability floor."""
    return SuffixDrafter(options["suffix_min_prob"])
