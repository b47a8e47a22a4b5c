"""How many tokens a sequence drafts next: a fixed k (the paper's), or a k that follows the sequence's own acceptance.

Under batching every drafted row costs (docs/serving.md), and a row that is rejected is pure loss. An adaptive k
drafts about as many tokens as the sequence's recent steps kept, plus one to find out whether it keeps more: an
exponentially weighted mean (EWMA) of the drafted tokens accepted per step, k = clamp(round(mean) + 1, 1, num_draft).
It only changes how many tokens are verified, never which are emitted, so decoding stays lossless whatever k is.
"""

from __future__ import annotations

WEIGHT = 0.5  # of the newest step in the mean: a sequence's acceptance shifts within a few steps (prose to code)
RATE_WEIGHT = 0.25  # of the newest step in the per-position rate: one rejection should not halve it


class DraftLength:
    """``k`` for the next step; ``observe`` each step's drafted and accepted counts. Starts at ``num_draft``."""

    def __init__(self, num_draft: int, adaptive: bool):
        self.num_draft, self.adaptive = num_draft, adaptive
        self._mean = float(num_draft - 1)  # optimistic: the first step drafts the full k, as a fixed k would
        # per drafted position: the chance it is kept, given the ones before it were (decayed counts; prior 1 of 1)
        self._kept, self._tried = 1.0, 1.0

    @property
    def k(self) -> int:
        if not self.adaptive:
            return self.num_draft
        return max(1, min(self.num_draft, round(self._mean) + 1))

    @property
    def rate(self) -> float:
        """The estimated chance that a drafted token is accepted once the ones before it were: a position ``j`` (from 1)
        is kept with about ``rate ** j`` (what ``serve.row_budget`` weighs a drafted row by)."""
        return self._kept / self._tried

    def observe(self, drafted: int, accepted: int) -> None:
        """A step's outcome; one with nothing drafted (the drafter found no match) says nothing of acceptance."""
        if drafted:
            self._mean += WEIGHT * (accepted - self._mean)
            tried = accepted + (accepted < drafted)  # the positions judged: the kept ones and the first rejected one
            self._kept += RATE_WEIGHT * (accepted - self._kept)
            self._tried += RATE_WEIGHT * (tried - self._tried)
