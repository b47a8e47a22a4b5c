"""Which drafted rows a batched serving step computes: rows whose expected tokens pay for their time.

A drafted token past a sequence's first, at position ``j`` (kept with about ``r ** j``, ``DraftLength.rate``), is computed
if ``r ** j >= c * tokens_per_second``, ``c`` a row's cost in a decayed least-squares fit of seconds on (1, sequences, rows)."""

from __future__ import annotations

import numpy as np

DECAY = 0.95  # weight of the older forwards at each new one: the fit follows the last few dozen
MIN_FORWARDS = 8  # forwards seen before the fit is trusted
MIN_SPREAD = 1.0  # rows: the spread of rows, sequences held fixed, that the fit needs before it gives a slope


class RowBudget:
    """``keep`` says how many of a sequence's drafted tokens a forward computes; ``observe`` each forward of verify blocks."""

    def __init__(self) -> None:
        self._moments = np.zeros((3, 3))  # decayed sums of x x^T for x = (1, sequences, rows)
        self._against = np.zeros(3)  # decayed sums of x * seconds
        self._tokens = self._token_seconds = 0.0
        self._forwards = 0

    def observe(self, rows: int, sequences: int, seconds: float, tokens: int) -> None:
        """One forward of ``sequences`` verify blocks, ``rows`` rows in all, that took ``seconds`` and emitted ``tokens``."""
        x = np.array([1.0, sequences, rows])
        self._moments = DECAY * self._moments + np.outer(x, x)
        self._against = DECAY * self._against + x * seconds
        self._tokens = DECAY * self._tokens + tokens
        self._token_seconds = DECAY * self._token_seconds + seconds
        self._forwards += 1

    @property
    def seconds_per_row(self) -> float | None:
        """The fitted cost of one more row in a forward of the same sequences; None until it can be trusted."""
        if self._forwards < MIN_FORWARDS:
            return None
        weight = self._moments[0, 0]
        centred = self._moments[1:, 1:] / weight - np.outer(self._moments[0, 1:], self._moments[0, 1:]) / weight**2
        covariance = self._against[1:] / weight - self._moments[0, 1:] * self._against[0] / weight**2
        if centred[0, 0] < 1e-9:  # one number of sequences throughout: rows alone
            return None if centred[1, 1] < MIN_SPREAD**2 else max(0.0, float(covariance[1] / centred[1, 1]))
        if np.linalg.det(centred) / centred[0, 0] < MIN_SPREAD**2:  # rows' variance once sequences explain theirs
            return None
        return max(0.0, float(np.linalg.solve(centred, covariance)[1]))

    @property
    def threshold(self) -> float:
        """The expected tokens a drafted row past the first must be worth to be computed (0: compute every row)."""
        slope = self.seconds_per_row
        if slope is None or self._token_seconds <= 0:
            return 0.0
        return slope * self._tokens / self._token_seconds

    def keep(self, rate: float, drafted: int) -> int:
        """How many of ``drafted`` tokens, from the first, to compute for a sequence whose drafts are kept at ``rate``."""
        if drafted == 0:
            return 0
        threshold, kept, worth = self.threshold, 1, rate * rate
        while kept < drafted and worth >= threshold:
            kept, worth = kept + 1, worth * rate
        return kept
