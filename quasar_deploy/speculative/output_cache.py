"""Earlier generations' outputs, for the suffix drafter to draft from across requests (SuffixDecoding's global tree).

Opt-in: lossless, but a request's speed says whether similar text was generated before (docs/security.md)."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence

from ..errors import QuasarError
from .suffix_tree import DEPTH, Node, anchor, best_draft, node_of


class OutputCache:
    """At most ``max_tokens`` tokens of earlier outputs, indexed; thread-safe. ``add`` an output, ``propose`` a draft."""

    def __init__(self, max_tokens: int, depth: int = DEPTH):
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise QuasarError(f"the output cache holds at least 1 token, got {max_tokens!r}")
        self.max_tokens, self.depth = max_tokens, depth
        self._root = Node()
        self._outputs: deque[list[int]] = deque()
        self._held = 0
        self._lock = threading.Lock()

    @property
    def tokens(self) -> int:
        """Tokens of output held now."""
        return self._held

    def add(self, output: Sequence[int]) -> None:
        """Index ``output`` (its last ``max_tokens`` tokens), then let the oldest outputs go until the cap holds."""
        if not (output := list(output)[-self.max_tokens :]):
            return
        with self._lock:
            self._count(output, 1)
            self._outputs.append(output)
            self._held += len(output)
            while self._held > self.max_tokens:
                oldest = self._outputs.popleft()
                self._held -= len(oldest)
                self._count(oldest, -1)

    def _count(self, output: list[int], delta: int) -> None:
        """Add ``delta`` to the count of every substring of ``output`` of at most ``depth`` tokens."""
        for start in range(len(output)):
            node = self._root
            for token in output[start : start + self.depth]:
                child = node.children.get(token)
                if child is None:
                    child = node.children[token] = Node()
                child.count += delta
                node.continued += delta
                if delta > 0:
                    if node.best is None or child.count > node.best[1].count:
                        node.best = (token, child)
                    node = child
                    continue
                if node.best is not None and node.best[0] == token:
                    node.best = None  # recounted below, once this child's count is final
                if child.count == 0:
                    del node.children[token]  # everything under it occurred only inside what left: gone with it
                if node.best is None and node.children:
                    node.best = max(node.children.items(), key=lambda item: item[1].count)
                if child.count == 0:
                    break
                node = child

    def propose(self, context: Sequence[int], k: int, min_prob: float, spec_factor: int) -> tuple[list[int], float]:
        """The suffix drafter's ``best_draft`` from ``context``'s ends over the outputs held, and its expected kept tokens."""
        tail = list(context[-self.depth :])
        with self._lock:
            matches = ((n, node_of(self._root, tail[len(tail) - n :])) for n in range(min(len(tail), self.depth - 1), 0, -1))
            found = ((n, node) for n, node in matches if node is not None)
            return best_draft(found, k, min_prob, spec_factor, lambda draft: anchor(self._root, [*tail, *draft], self.depth))
