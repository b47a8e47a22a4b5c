"""The suffix tree that suffix drafting matches against (``suffix.py``, and across requests ``output_cache.py``): a trie of
every substring of at most ``DEPTH`` tokens, each node counting its occurrences and keeping its most frequent child,
and the walks that turn matched contexts into drafts."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

DEPTH = 16  # the longest substring indexed: each appended token costs this many node updates


class Node:
    """One substring: its ``count``, its children's total (``continued``) and its most frequent (of equals, latest) child."""

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
        if (node := node.children.get(token)) is None:
            return None
    return node


def anchor(root: Node, text: Sequence[int], depth: int) -> Node | None:
    """The node of the longest suffix of ``text`` (at most depth - 1 tokens) that something followed, or None."""
    for length in range(min(depth - 1, len(text)), 0, -1):
        if (node := node_of(root, text[len(text) - length :])) is not None and node.best is not None:
            return node
    return None


def walk(node: Node, k: int, min_prob: float, resume: Callable[[list[int]], Node | None]) -> tuple[list[int], float]:
    """Up to ``k`` most frequent next tokens from ``node`` while their running probability stays at least ``min_prob``,
    and the sum of those probabilities; where the counts run out, ``resume(draft)`` gives the node to go on from."""
    draft: list[int] = []
    chance, expected = 1.0, 0.0
    while len(draft) < k:
        if node.best is None:
            if (resumed := resume(draft)) is None:
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
    matches: Iterable[tuple[int, Node]], k: int, min_prob: float, spec_factor: int, resume: Callable[[list[int]], Node | None]
) -> tuple[list[int], float]:
    """Of the walks from each matched (length, node), longest first, at most ``spec_factor`` per matched token: the best."""
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
