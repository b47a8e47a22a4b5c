"""How many tokens a sequence drafts next: a fixed k (the paper's), or a k that follows the sequence's own acceptance.

Under batching every drafted row costs (docs/serving.md), and a row that is rejected is pure loss. An adaptive k
drafts about as many tokens as the sequence's recent steps kept, plus one to find out whether it keeps more: an
exponentially weighted mean (EWMA) of the drafted tokens accepted per step, k = clamp(round(mean) + 1, 1, num_draft).
It only changes how many tokens are verified, never which are emitted, so decoding stays lossless whatever k is.
"""

from __future__ import annotations

WEIGHT = 0.5  # of the newest step in the mean: a sequence's acceptance shifts within a few steps (prose to code)


class DraftLength:
    """``k`` for the next step; ``observe`` each step's drafted and accepted counts. Starts at ``num_draft``."""

    def __init__(self, num_draft: int, adaptive: bool):
        self.num_draft, self.adaptive = num_draft, adaptive
        self._mean = float(num_draft - 1)  # optimistic: the first step drafts the full k, as a fixed k would

    @property
    def k(self) -> int:
        if not self.adaptive:
            return self.num_draft
        return max(1, min(self.num_draft, round(self._mean) + 1))

    def observe(self, drafted: int, accepted: int) -> None:
        """A step's outcome; one with nothing drafted (the drafter found no match) says nothing of acceptance."""
        if drafted:
            self._mean += WEIGHT * (accepted - self._mean)
