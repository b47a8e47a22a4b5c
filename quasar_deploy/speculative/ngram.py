"""Prompt lookup (n-gram) drafting: continue the text the way it continued the last time it read the same."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..errors import QuasarError
from .acceptance import Sampler
from .drafters import NO_DRAFT, Draft

if TYPE_CHECKING:
    from .drafters import DrafterContext


def check_ngram_range(ngram_min: int, ngram_max: int) -> None:
    if isinstance(ngram_min, bool) or not isinstance(ngram_min, int) or ngram_min < 1:
        raise QuasarError(f"ngram_min must be an integer >= 1, got {ngram_min!r}")
    if isinstance(ngram_max, bool) or not isinstance(ngram_max, int) or ngram_max < ngram_min:
        raise QuasarError(f"ngram_max must be an integer >= ngram_min ({ngram_min}), got {ngram_max!r}")


class NgramDrafter:
    """Matches the last n tokens (longest n first) against everything before them and proposes what followed."""

    def __init__(self, ngram_min: int = 1, ngram_max: int = 3):
        check_ngram_range(ngram_min, ngram_max)
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        self._latest: dict[tuple[int, ...], int] = {}
        self._indexed_to = 0  # n-grams ending at or before this position are indexed
        self._undo: list[tuple[int, tuple[int, ...], int | None]] | None = None  # (end, n-gram, end replaced) once rewound

    def _index(self, tokens: Sequence[int]) -> None:
        # an n-gram ending at ``end`` is indexed once tokens[end] exists: a lookup never finds itself
        for end in range(self._indexed_to + 1, len(tokens)):
            for n in range(self.ngram_min, min(self.ngram_max, end) + 1):
                key = tuple(tokens[end - n : end])
                if self._undo is not None:
                    self._undo.append((end, key, self._latest.get(key)))
                self._latest[key] = end
        self._indexed_to = max(self._indexed_to, len(tokens) - 1)

    def rewind(self, length: int) -> None:
        """Take back every entry whose next token sits at or past ``length``, as if only those tokens were indexed."""
        for end, key, previous in reversed(self._undo or []):
            if end < length:
                break
            if previous is None:
                del self._latest[key]
            else:
                self._latest[key] = previous
        self._undo = []
        self._indexed_to = min(self._indexed_to, max(length - 1, 0))

    def propose(self, tokens: Sequence[int], k: int, sampler: Sampler) -> Draft:
        self._index(tokens)
        length = len(tokens)
        for n in range(min(self.ngram_max, length), self.ngram_min - 1, -1):
            if (end := self._latest.get(tuple(tokens[length - n :]))) is not None:
                draft: list[int] = []
                for j in range(k):
                    # copy with overlap (like LZ77), so a repeating pattern yields a full k tokens
                    position = end + j
                    draft.append(tokens[position] if position < length else draft[position - length])
                return Draft(draft)
        return NO_DRAFT


def ngram_drafter(context: DrafterContext, options: Mapping[str, Any]) -> NgramDrafter:
    """The registry's factory for "ngram": model-free, so it needs only its n range."""
    return NgramDrafter(options["ngram_min"], options["ngram_max"])
