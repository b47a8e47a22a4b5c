"""The suffix tree that suffix drafting matches against (``suffix.py``, and across requests ``output_cache.py``): a trie of
every substring of at most ``DEPTH`` tokens, each node counting its occurrences and keeping its most frequent child,
and the walks that turn matched contexts into drafts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

# the longest substring indexed, so the longest context matched is 15 tokens (n-gram lookup's is 3); each appended token
# costs this many node updates (about 3 us each in CPython), so a deeper tree costs more than longer contexts win.
# vLLM's suffix tree is bounded the same way (24 by default)
DEPTH = 16


class Node:
    """One substring: how often it occurred (``count``), how often something followed it (``continued``, the sum of
    its children's counts), and its most frequent next token (``best``; of equals, the one seen latest, as n-gram
    lookup prefers recent text), kept up to date as counts grow so a draft's pick is O(1)."""

    __slots__ = ("best", "children", "continued", "count")

    def __init__(self) -> None:
        self.children: dict[int, Node] = {}
        self.count = 0
        self.continued = 0
        self.best: tuple[int, Node] | None = None


def node_of(root: Node, text: Sequence[int]) -> Node | None:
    """The node of ``text`` under ``root`` (``text`` occurred), or None."""
    node: Node | None = root
    for token in text:
        node = node.children.get(token)
        if node is None:
            return None
    return node


def anchor(root: Node, text: Sequence[int], depth: int) -> Node | None:
    """The node of the longest suffix of ``text`` (at most depth - 1 tokens) that something followed, or None."""
    for length in range(min(depth - 1, len(text)), 0, -1):
        node = node_of(root, text[len(text) - length :])
        if node is not None and node.best is not None:
            return node
    return None


def walk(node: Node, k: int, min_prob: float, resume: Callable[[list[int]], Node | None]) -> tuple[list[int], float]:
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
    matches: Iterable[tuple[int, Node]],
    k: int,
    min_prob: float,
    spec_factor: int,
    resume: Callable[[list[int]], Node | None],
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
