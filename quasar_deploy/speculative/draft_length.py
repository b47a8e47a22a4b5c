"""How many tokens a sequence drafts next: a fixed k (the paper's), or a k that follows the sequence's own acceptance.

Adaptive: k = clamp(round(EWMA of accepted drafts) + 1, 1, num_draft), since under batching a rejected row is pure loss."""

from __future__ import annotations

WEIGHT = 0.5  # of the newest step in the mean: a sequence's acceptance shifts within a few steps (prose to code)
RATE_WEIGHT = 0.25  # of the newest step in the per-position rate: one rejection should not halve it


class DraftLength:
    """``k`` for the next step; ``observe`` each step's drafted and accepted counts. Starts at ``num_draft``."""

    def __init__(self, num_draft: int, adaptive: bool):
        self.num_draft, self.adaptive = num_draft, adaptive
        self._mean = float(num_draft - 1)  # optimistic: the first step drafts the full k, as a fixed k would
        self._kept, self._tried = 1.0, 1.0  # decayed counts of drafted positions kept and judged (``rate``)

    @property
    def k(self) -> int:
        if not self.adaptive:
            return self.num_draft
        return max(1, min(self.num_draft, round(self._mean) + 1))

    @property
    def rate(self) -> float:
        """The estimated chance a drafted token is kept once those before it were: position ``j`` at ``rate ** j``."""
        return self._kept / self._tried

    def observe(self, drafted: int, accepted: int) -> None:
        """A step's outcome; one with nothing drafted (the drafter found no match) says nothing of acceptance."""
        if drafted:
            self._mean += WEIGHT * (accepted - self._mean)
            tried = accepted + (accepted < drafted)  # the positions judged: the kept ones and the first rejected one
            self._kept += RATE_WEIGHT * (accepted - self._kept)
            self._tried += RATE_WEIGHT * (tried - self._tried)
