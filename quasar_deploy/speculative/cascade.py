"""Exact mode: the float model's own output at speculative speed, with its W8A8 copy as the middle level of a cascade.

Each proposal runs r rounds of W8A8 verifying the inner drafter (``RoundPolicy``); the float model verifies the result
through the ordinary loop, so what it emits is its own. docs/architecture.md, "Exact mode", has the speed model."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import torch

from ..errors import QuasarError
from .acceptance import Sampler, accept
from .causal_lm import CausalLM
from .drafters import NO_DRAFT, Draft, RewindableDrafter
from .loop import LoopStats

MAX_ROUNDS = 8  # the adaptive choice's ceiling: float acceptance decays geometrically with the draft's length
SMOOTHING = 0.2  # weight of the newest observation in the running acceptance estimates
COST_MEMORY = 0.95  # each older forward's weight in the step-cost fits: about the last 20 count
PRIOR_ACCEPTANCE, PRIOR_TOKENS = 0.9, 10  # prior float acceptance of W8A8's tokens, worth PRIOR_TOKENS observations
ROUNDS_MARGIN = 1.1  # rounds must promise this much more than r = 0: the estimates are noisy
CATCH_UP_BLOCK = 64  # W8A8 catches up on tokens it missed (rounds switched off) this many per forward, bounding the logits


@dataclass
class CascadeStats(LoopStats):
    """``LoopStats`` of the float verifier, plus the W8A8 middle level's share; ``direct_steps``: steps with r = 0."""

    middle_rounds: int = 0
    middle_s: float = 0.0
    middle_catch_up_s: float = 0.0
    middle_tokens: int = 0
    direct_steps: int = 0


def expected_tokens(draft_length: float, acceptance: float) -> float:
    """Tokens a float step emits on a draft of ``draft_length`` tokens, each accepted with probability ``acceptance``."""
    if acceptance >= 1:
        return 1 + draft_length
    return 1 + acceptance * (1 - acceptance**draft_length) / (1 - acceptance)


def cascade_rate(
    rounds: int, tokens_per_verify: float, proposal_length: float, acceptance: float, middle_cost: StepCost, verify_cost: StepCost
) -> float:
    """The speed model (``RoundPolicy``): tokens per second with ``rounds`` W8A8 rounds per float step."""
    block = 1 + proposal_length
    if rounds == 0:
        return tokens_per_verify / verify_cost(block)
    drafted = rounds * tokens_per_verify
    return expected_tokens(drafted, acceptance) / (rounds * middle_cost(block) + verify_cost(1 + drafted))


def modelled_gain(
    tokens_per_verify: float,
    proposal_length: float,
    acceptance: float,
    middle_cost: StepCost,
    verify_cost: StepCost,
    max_rounds: int = MAX_ROUNDS,
    efficiency: float = 1.0,
) -> tuple[int, float]:
    """The rounds ``RoundPolicy.choose`` would run and their rate (times ``efficiency``) over r = 0's, or (0, 1.0)."""
    args = (tokens_per_verify, proposal_length, acceptance, middle_cost, verify_cost)
    best = max(range(max_rounds + 1), key=lambda r: (cascade_rate(r, *args), -r))
    gain = efficiency * cascade_rate(best, *args) / cascade_rate(0, *args)
    return (best, gain) if best > 0 and gain >= ROUNDS_MARGIN else (0, 1.0)


class Realized:
    """Tokens proposals made against those their predicted rates promised in their time, recent ones weighing more."""

    def __init__(self):
        self.made = self.promised = 0.0

    def observe(self, predicted_rate: float, tokens: int, seconds: float) -> None:
        self.made = COST_MEMORY * self.made + tokens
        self.promised = COST_MEMORY * self.promised + predicted_rate * seconds

    def ratio(self) -> float:
        """Made over promised; 1.0 before any proposal (nothing yet says the predictions are off)."""
        return self.made / self.promised if self.promised > 0 else 1.0


class StepCost:
    """A model's seconds per forward as ``fixed + per_position * positions``, a least-squares fit decayed by COST_MEMORY."""

    def __init__(self):
        self._n = self._x = self._y = self._xx = self._xy = 0.0

    @property
    def measured(self) -> bool:
        return self._n > 0

    def observe(self, positions: int, seconds: float) -> None:
        self._n = COST_MEMORY * self._n + 1
        self._x = COST_MEMORY * self._x + positions
        self._y = COST_MEMORY * self._y + seconds
        self._xx = COST_MEMORY * self._xx + positions * positions
        self._xy = COST_MEMORY * self._xy + positions * seconds

    def __call__(self, positions: float) -> float:
        """Predicted seconds for ``positions``; through the origin for a negative intercept, the mean for no slope."""
        n, x, y = self._n, self._x, self._y
        spread = self._xx - x * x / n
        slope = (self._xy - x * y / n) / spread if spread > 1e-9 * n else 0.0
        if slope <= 0:
            return y / n
        fixed = (y - slope * x) / n
        if fixed < 0:
            return self._xy / self._xx * positions
        return fixed + slope * positions


class RoundPolicy:
    """How many W8A8 rounds to run before each float step: ``rounds`` when fixed, else the count that maximises the
    predicted tokens per second (one until both costs are measured). With c(n), C(n) a W8A8 and a float forward's
    seconds, P the proposal length, L the tokens a verify keeps and a the float acceptance of W8A8's tokens, r = 0 emits
    L tokens per C(1 + P), r rounds ``expected_tokens(r L, a)`` per r c(1 + P) + C(1 + r L)."""

    def __init__(self, rounds: int | None = None, max_rounds: int = MAX_ROUNDS):
        check_rounds(rounds)
        self.rounds, self.max_rounds = rounds, max_rounds
        self.middle_cost, self.verify_cost = StepCost(), StepCost()
        self.tokens_per_verify: float | None = None
        self.proposal_length: float | None = None
        self._kept, self._tried = PRIOR_ACCEPTANCE * PRIOR_TOKENS, float(PRIOR_TOKENS)
        self.with_rounds, self.direct = Realized(), Realized()  # proposals with W8A8 rounds, and r = 0 steps
        self.streak_length: float | None = None  # mean proposals in a row with rounds: a catch-up is repaid only then
        self._streak = 0

    @property
    def efficiency(self) -> float:
        """Tokens cycles with rounds made over what their predictions promised, at most 1.0 (the model leaves costs out)."""
        return min(1.0, self.with_rounds.ratio())

    @property
    def direct_efficiency(self) -> float:
        """Tokens r = 0 steps made over what their prediction promised, at least 1.0: rounds must beat that too."""
        return max(1.0, self.direct.ratio())

    @property
    def acceptance(self) -> float:
        return self._kept / self._tried

    @property
    def rates_known(self) -> bool:
        """Both step costs and the tokens per verify measured: ``rate`` can predict."""
        return self.middle_cost.measured and self.verify_cost.measured and self.tokens_per_verify is not None

    def choose(self, behind: int = 0, remaining: int | None = None) -> int:
        """The rounds for the next proposal, ``behind`` and ``remaining`` as for ``rate``."""
        if self.rounds is not None:
            return self.rounds
        if not self.rates_known:
            return 1
        best = max(range(self.max_rounds + 1), key=lambda r: (self.rate(r, behind, remaining), -r))
        bar = ROUNDS_MARGIN * self.direct_efficiency * self.rate(0)
        chosen = best if self.efficiency * self.rate(best, behind, remaining) >= bar else 0
        if chosen:
            self._streak += 1
        elif self._streak:
            self.streak_length = _average(self.streak_length, self._streak)
            self._streak = 0
        return chosen

    def rate(self, rounds: int, behind: int = 0, remaining: int | None = None) -> float:
        """Predicted tokens per second with ``rounds`` rounds per float step, a W8A8 catch-up of ``behind`` positions
        charged to the float steps left in ``remaining`` tokens."""
        rate = cascade_rate(rounds, self.tokens_per_verify, self.proposal_length, self.acceptance, self.middle_cost, self.verify_cost)
        if rounds == 0 or behind <= 0:  # r = 0 needs no W8A8 cache
            return rate
        tokens = expected_tokens(rounds * self.tokens_per_verify, self.acceptance)
        steps_left = max(1.0, min((remaining if remaining is not None else tokens) / tokens, self.streak_length or float("inf")))
        return tokens / (tokens / rate + self.middle_cost(behind) / steps_left)

    def gain_at(self, tokens_per_verify: float) -> tuple[int, float] | None:
        """``modelled_gain`` from this policy's estimates at another ``tokens_per_verify``; None until they are measured."""
        if not (self.middle_cost.measured and self.verify_cost.measured and self.proposal_length is not None):
            return None
        args = (tokens_per_verify, self.proposal_length, self.acceptance, self.middle_cost, self.verify_cost)
        return modelled_gain(*args, self.max_rounds, self.efficiency / self.direct_efficiency)

    def observe_proposal(self, length: int) -> None:
        """The inner drafter proposed ``length`` tokens."""
        self.proposal_length = _average(self.proposal_length, length)

    def observe_round(self, positions: int, seconds: float, tokens: int) -> None:
        """A W8A8 round took ``seconds`` on ``positions`` and kept ``tokens`` (accepted proposal plus its own)."""
        self.middle_cost.observe(positions, seconds)
        self.tokens_per_verify = _average(self.tokens_per_verify, tokens)

    def observe_cycle(self, predicted_rate: float, tokens: int, seconds: float) -> None:
        """A proposal with W8A8 rounds, predicted at ``predicted_rate``, made ``tokens`` in ``seconds`` (``efficiency``)."""
        self.with_rounds.observe(predicted_rate, tokens, seconds)

    def observe_direct(self, predicted_rate: float, tokens: int, seconds: float) -> None:
        """An r = 0 step, predicted at ``predicted_rate``, made ``tokens`` in ``seconds`` (``direct_efficiency``)."""
        self.direct.observe(predicted_rate, tokens, seconds)

    def observe_step(self, positions: int, seconds: float, kept: int, drafted: int, from_middle: bool) -> None:
        """A float step took ``seconds`` on ``positions`` and kept ``kept`` of ``drafted`` tokens, W8A8's or not."""
        self.verify_cost.observe(positions, seconds)
        if from_middle:
            self._kept += kept
            self._tried += kept + (kept < drafted)  # the rejected token, if one was
        else:
            self.tokens_per_verify = _average(self.tokens_per_verify, kept + 1)


def _average(current: float | None, value: float) -> float:
    return value if current is None else current + SMOOTHING * (value - current)


def check_rounds(rounds: int | None) -> None:
    if rounds is not None and (isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 0):
        raise QuasarError(f"rounds must be an integer >= 0, or None (chosen as it runs), got {rounds!r}")


class CascadeDrafter:
    """Drafts for the float verifier with W8A8 rounds on ``middle`` over the ``inner`` drafter's proposals of ``num_draft``."""

    def __init__(
        self,
        middle: CausalLM,
        inner: RewindableDrafter,
        num_draft: int,
        stop_ids: Collection[int],
        policy: RoundPolicy,
        stats: CascadeStats,
    ):
        self.middle, self.inner, self.num_draft, self.stop_ids = middle, inner, num_draft, frozenset(stop_ids)
        self.policy, self.stats = policy, stats
        self._cached: list[int] = []  # the tokens whose keys and values the middle cache holds
        self._final = 0  # tokens of the sequence known final at the last proposal
        self._draft: list[int] = []  # the last proposal
        self._from_middle = False  # whether W8A8 rounds made it
        self._seen_steps, self._seen_s = 0, 0.0  # the loop's verify counters at the last proposal
        self._cycle: tuple[float, float] | None = None  # the last proposal's predicted rate and seconds (no catch-up)

    def propose(self, tokens: Sequence[int], k: int, sampler: Sampler) -> Draft:
        self._settle(tokens)
        rounds = self.policy.choose(behind=len(tokens) - 1 - len(self._cached), remaining=k)
        predicted = self.policy.rate(rounds) if self.policy.rates_known else None  # a catch-up is charged apart
        if rounds == 0:
            self.stats.direct_steps += 1
            began = time.perf_counter()
            draft = self.inner.propose(tokens, min(self.num_draft, k), sampler)
            self._cycle = (predicted, time.perf_counter() - began) if predicted is not None else None
            self._draft, self._from_middle = draft.tokens[:k], False
            self.policy.observe_proposal(len(self._draft))
            return draft
        began, caught_up = time.perf_counter(), self.stats.middle_catch_up_s
        draft, dists = self._rounds(list(tokens), k, rounds, sampler)
        rounds_s = time.perf_counter() - began - (self.stats.middle_catch_up_s - caught_up)
        self._cycle = (predicted, rounds_s) if predicted is not None else None
        self._draft, self._from_middle = draft, True
        self.stats.middle_tokens += len(draft)
        return Draft(draft, torch.cat(dists) if dists else None)

    def _settle(self, tokens: Sequence[int]) -> None:
        """Judge the last proposal by what the loop kept of it; roll the middle cache and the inner drafter back to that."""
        kept = 0
        while kept < len(self._draft) and self._final + kept < len(tokens) and tokens[self._final + kept] == self._draft[kept]:
            kept += 1
        steps, seconds = self.stats.verify_steps, self.stats.verify_s
        if steps == self._seen_steps + 1:  # one float step on the last proposal (none: this is the first)
            self.policy.observe_step(1 + len(self._draft), seconds - self._seen_s, kept, len(self._draft), self._from_middle)
            if self._cycle is not None:
                predicted, made_s = self._cycle
                observe = self.policy.observe_cycle if self._from_middle else self.policy.observe_direct
                observe(predicted, kept + 1, made_s + seconds - self._seen_s)
        self._seen_steps, self._seen_s, self._cycle = steps, seconds, None
        final = self._final + kept  # past it, the float model's own token replaced (or followed) the draft
        if len(self._cached) > final:
            del self._cached[final:]
            self.middle.truncate(final)
        self.inner.rewind(final)
        self._final = len(tokens)

    def _rounds(self, tokens: list[int], limit: int, rounds: int, sampler: Sampler) -> tuple[list[int], list[torch.Tensor]]:
        """Up to ``rounds`` W8A8 rounds, the draft at most ``limit`` tokens; the draft and (sampling) each token's distribution."""
        draft: list[int] = []
        dists: list[torch.Tensor] = []
        for _ in range(rounds):
            room = limit - len(draft)
            if room <= 0 or any(t in self.stop_ids for t in draft):
                break
            sequence = tokens + draft
            k = min(self.num_draft, room - 1)  # a round keeps at most k + 1 tokens
            proposal = self.inner.propose(sequence, k, sampler) if k > 0 else NO_DRAFT
            proposed = proposal.tokens[:k]
            self.policy.observe_proposal(len(proposed))
            began = time.perf_counter()
            missed = self._catch_up(sequence)
            round_began = time.perf_counter()
            logits = self.middle.verify([*missed, sequence[-1], *proposed])[len(missed) :]
            verdict = accept(logits, proposed, proposal.probs[:k] if proposal.probs is not None else None, sampler)
            self._cached += [*missed, sequence[-1], *proposed[: verdict.accepted]]
            self.middle.truncate(len(self._cached))
            ended = time.perf_counter()
            self.policy.observe_round(len(missed) + 1 + len(proposed), ended - round_began, len(verdict.tokens))
            self.stats.middle_rounds += 1
            self.stats.middle_s += ended - round_began
            self.stats.middle_catch_up_s += round_began - began
            if not sampler.greedy:  # each kept token was drawn, in effect, from W8A8's distribution at its position
                dists.append(sampler.distribution(logits[: len(verdict.tokens)]))
            draft += verdict.tokens
        return draft, dists

    def _catch_up(self, sequence: list[int]) -> list[int]:
        """The tokens of ``sequence`` but its last that the middle cache misses, after catching up to ``CATCH_UP_BLOCK``."""
        if not self._cached:
            self._timed(self.middle.prefill, sequence[:-1])
            self._cached = sequence[:-1]
        missed = sequence[len(self._cached) : -1]
        while len(missed) > CATCH_UP_BLOCK:
            self._timed(self.middle.verify, missed[:CATCH_UP_BLOCK])
            self._cached += missed[:CATCH_UP_BLOCK]
            missed = missed[CATCH_UP_BLOCK:]
        return missed

    def _timed(self, forward: Callable[[list[int]], object], block: list[int]) -> None:
        """A catch-up forward, timed into the W8A8 cost fit (its long blocks give the fit its slope)."""
        began = time.perf_counter()
        forward(block)
        self.policy.middle_cost.observe(len(block), time.perf_counter() - began)
