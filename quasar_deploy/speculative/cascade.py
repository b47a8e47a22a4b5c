"""Exact mode: the float model's own output at speculative speed, with its W8A8 copy as the middle level of a cascade.

The cascade is a drafter for the float verifier. Each proposal runs r rounds on the
W8A8 model: the inner drafter (n-gram) proposes, W8A8 verifies as the speculative loop
would, and its accepted tokens plus its own next token extend the draft. The float model
then verifies the whole draft in one forward through the ordinary loop (``loop.Speculation``,
``acceptance.accept``), so what it emits is its own: greedy, token-identical to its own
greedy decode; sampled, rejection sampling against the distribution each drafted token was
drawn from. W8A8's speculative output is distributed, token by token, as W8A8's own
sampling (its ``accept`` guarantees that), so that distribution is W8A8's, and the float
model's rejection sampling turns it into the float model's.

Every proposal starts by settling the last one against the sequence the loop now holds:
what the float model kept of the draft is final, the W8A8 cache and the inner drafter roll
back to it. The rounds per proposal come from ``RoundPolicy``: fixed, or chosen from the
measured step costs and the acceptance seen so far (by this generation and, through an
engine's shared policy, the ones before it), down to r = 0 (the inner drafter's proposal goes
to the float model directly: plain float n-gram verification) when W8A8 rounds do not pay.
docs/architecture.md, "Exact mode", has the speed model.
"""

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
# prior for the float model's per-token acceptance of W8A8's tokens, worth PRIOR_TOKENS observations (top-1 agreement of
# a calibrated artifact with its float model is near 0.98; a lower prior keeps the first choices cautious)
PRIOR_ACCEPTANCE, PRIOR_TOKENS = 0.9, 10
# rounds must promise this much more than plain float verification of the drafts: the estimates are noisy, so a marginal
# gain predicted is a loss measured
ROUNDS_MARGIN = 1.1
CATCH_UP_BLOCK = 64  # W8A8 catches up on tokens it missed (rounds switched off) this many per forward, bounding the logits


@dataclass
class CascadeStats(LoopStats):
    """``LoopStats`` of the float verifier (its steps, its acceptance of the drafts), plus the W8A8 middle level's share.

    ``middle_rounds``: W8A8 rounds; ``middle_s``: seconds in their forwards (per round: the c of the speed
    model); ``middle_catch_up_s``: seconds bringing the W8A8 cache up to the sequence (its prompt, tokens it
    missed at r = 0); ``middle_tokens``: tokens W8A8 put into the float model's drafts; ``direct_steps``:
    float steps that verified the inner drafter's proposal directly (r = 0).
    """

    middle_rounds: int = 0
    middle_s: float = 0.0
    middle_catch_up_s: float = 0.0
    middle_tokens: int = 0
    direct_steps: int = 0


def expected_tokens(draft_length: float, acceptance: float) -> float:
    """Tokens a float step emits on a draft of ``draft_length`` tokens that it accepts token by token with probability
    ``acceptance``: the accepted prefix (its expectation is a geometric sum) plus the float model's own next token."""
    if acceptance >= 1:
        return 1 + draft_length
    return 1 + acceptance * (1 - acceptance**draft_length) / (1 - acceptance)


def cascade_rate(
    rounds: int, tokens_per_verify: float, proposal_length: float, acceptance: float, middle_cost: StepCost, verify_cost: StepCost
) -> float:
    """The speed model (``RoundPolicy``): tokens per second with ``rounds`` W8A8 rounds per float step, each verify of
    the inner drafter's ``proposal_length`` tokens keeping ``tokens_per_verify``, the float step accepting each W8A8
    token with probability ``acceptance``; r = 0 is plain float verification of the inner drafter's proposals."""
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
    """The rounds ``RoundPolicy.choose`` would run, and their rate over r = 0's: exact mode's speed-up over plain float
    verification of the same drafts, where these estimates hold, the rounds' rate scaled by ``efficiency``
    (``RoundPolicy.efficiency``); rounds promising less than ``ROUNDS_MARGIN`` are not run: 0 rounds, a gain of 1."""
    args = (tokens_per_verify, proposal_length, acceptance, middle_cost, verify_cost)
    best = max(range(max_rounds + 1), key=lambda r: (cascade_rate(r, *args), -r))
    gain = efficiency * cascade_rate(best, *args) / cascade_rate(0, *args)
    return (best, gain) if best > 0 and gain >= ROUNDS_MARGIN else (0, 1.0)


class Realized:
    """Tokens some proposals made, and the tokens their predicted rates promised in the time they took, recent ones
    weighing more (``COST_MEMORY``): what the speed model's predictions are worth (``RoundPolicy.efficiency``)."""

    def __init__(self):
        self.made = self.promised = 0.0

    def observe(self, predicted_rate: float, tokens: int, seconds: float) -> None:
        self.made = COST_MEMORY * self.made + tokens
        self.promised = COST_MEMORY * self.promised + predicted_rate * seconds

    def ratio(self) -> float:
        """Made over promised; 1.0 before any proposal (nothing yet says the predictions are off)."""
        return self.made / self.promised if self.promised > 0 else 1.0


class StepCost:
    """A model's seconds per verify forward as ``fixed + per_position * positions``, fitted by least squares to the
    forwards seen, recent ones weighing more (``COST_MEMORY``).

    Positions matter: a float step on a long cascade draft reads the weights once, as a short one
    does, but computes every position, and on a CPU that share is large.
    """

    def __init__(self):
        self._n = self._x = self._y = self._xx = self._xy = 0.0

    @property
    def measured(self) -> bool:
        return self._n > 0

    def observe(self, positions: int, seconds: float) -> None:
        keep = COST_MEMORY
        self._n = keep * self._n + 1
        self._x = keep * self._x + positions
        self._y = keep * self._y + seconds
        self._xx = keep * self._xx + positions * positions
        self._xy = keep * self._xy + positions * seconds

    def __call__(self, positions: float) -> float:
        """Predicted seconds for ``positions``; a line through the origin where the fit's intercept comes out negative,
        the mean where every forward had the same length or the fit's slope comes out negative."""
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
    predicted tokens per second.

    Estimates: c(n) and C(n), a W8A8 and a float forward's seconds on n positions (``StepCost``);
    P, the inner drafter's mean proposal length; L, the tokens a verify keeps of its proposal plus its
    own; a, the float model's per-token acceptance of W8A8's tokens. r = 0 emits L tokens per C(1 + P);
    r rounds draft about r L tokens, of which the float step keeps ``expected_tokens(r L, a)``, for
    r c(1 + P) + C(1 + r L). Until both costs have been measured it runs one round, to measure them.
    """

    def __init__(self, rounds: int | None = None, max_rounds: int = MAX_ROUNDS):
        check_rounds(rounds)
        self.rounds, self.max_rounds = rounds, max_rounds
        self.middle_cost, self.verify_cost = StepCost(), StepCost()
        self.tokens_per_verify: float | None = None
        self.proposal_length: float | None = None
        self._kept, self._tried = PRIOR_ACCEPTANCE * PRIOR_TOKENS, float(PRIOR_TOKENS)
        self.with_rounds, self.direct = Realized(), Realized()  # proposals with W8A8 rounds, and plain float steps (r = 0)
        # proposals in a row that ran rounds, on average: a catch-up is repaid only while rounds last
        self.streak_length: float | None = None
        self._streak = 0

    @property
    def efficiency(self) -> float:
        """Tokens the cycles with W8A8 rounds made over those their predicted rates promised in the time they took, at
        most 1.0 (1.0 before any): the model leaves costs out (the rounds' drafting and bookkeeping, the caches'
        rollback, a runtime waking after another's), and its cost fits can be flat where every forward had one length.
        A surplus does not inflate a promise: the catch-ups that follow rounds are priced apart, and cautiously."""
        return min(1.0, self.with_rounds.ratio())

    @property
    def direct_efficiency(self) -> float:
        """Tokens plain float steps (r = 0) made over those their predicted rate promised in the time they took, at least
        1.0 (1.0 before any). Rounds are weighed against r = 0's prediction: where plain steps beat it (the cost fit, pulled
        by the longer float steps of cascade drafts, overprices a short one), rounds must beat it by as much. A shortfall
        does not lower the bar: rounds that would only win against an underestimate of r = 0 are not taken."""
        return max(1.0, self.direct.ratio())

    @property
    def acceptance(self) -> float:
        return self._kept / self._tried

    @property
    def rates_known(self) -> bool:
        """Both step costs and the tokens per verify measured: ``rate`` can predict."""
        return self.middle_cost.measured and self.verify_cost.measured and self.tokens_per_verify is not None

    def choose(self, behind: int = 0, remaining: int | None = None) -> int:
        """The rounds for the next proposal. ``behind``: positions the W8A8 cache must take in before a round can run
        (the prompt, for a generation whose W8A8 cache is empty; the tokens made while rounds were off); ``remaining``:
        the tokens the generation may still make, over which that one-time cost is spread."""
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
        """Predicted tokens per second with ``rounds`` W8A8 rounds per float step (the estimates must be set), the
        catch-up of ``behind`` positions charged to the float steps left in ``remaining`` tokens (``choose``)."""
        rate = cascade_rate(rounds, self.tokens_per_verify, self.proposal_length, self.acceptance, self.middle_cost, self.verify_cost)
        if rounds == 0 or behind <= 0:  # r = 0 needs no W8A8 cache
            return rate
        tokens = expected_tokens(rounds * self.tokens_per_verify, self.acceptance)
        steps_left = max(1.0, min((remaining if remaining is not None else tokens) / tokens, self.streak_length or float("inf")))
        return tokens / (tokens / rate + self.middle_cost(behind) / steps_left)

    def gain_at(self, tokens_per_verify: float) -> tuple[int, float] | None:
        """``modelled_gain`` from this policy's measured step costs, proposal length, float acceptance of W8A8's tokens
        and efficiency, at another ``tokens_per_verify`` (bench: the speed model at the paper's acceptance); None before both costs and a
        proposal have been measured."""
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
        """A proposal with W8A8 rounds, predicted at ``predicted_rate`` tokens per second (its catch-up left out), made
        ``tokens`` in ``seconds``: its rounds (but their catch-up) and its float step (``efficiency``; recent cycles
        weigh more)."""
        self.with_rounds.observe(predicted_rate, tokens, seconds)

    def observe_direct(self, predicted_rate: float, tokens: int, seconds: float) -> None:
        """A plain float step (r = 0), predicted at ``predicted_rate`` tokens per second, made ``tokens`` in ``seconds``,
        its inner proposal included (``direct_efficiency``; recent steps weigh more)."""
        self.direct.observe(predicted_rate, tokens, seconds)

    def observe_step(self, positions: int, seconds: float, kept: int, drafted: int, from_middle: bool) -> None:
        """A float step took ``seconds`` on ``positions`` and kept ``kept`` of ``drafted`` tokens, which W8A8 made
        (``from_middle``) or the inner drafter proposed directly."""
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
    """Drafts for the float verifier with W8A8 rounds over an inner drafter's proposals (module docstring).

    ``middle`` is this sequence's W8A8 model (its own cache); ``num_draft`` is the inner drafter's k per
    round; ``k`` of ``propose`` is the most the float step may take (the loop's room). ``stats`` is the
    loop's: the float steps' times are read from it, the middle level's share written to it.
    """

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
        # the last proposal: its predicted rate (None: not yet predictable) and the seconds it took to make (its rounds'
        # but their catch-up, or the inner drafter's)
        self._cycle: tuple[float, float] | None = None

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
        """The tokens of ``sequence`` but its last that the middle cache still misses, at most ``CATCH_UP_BLOCK``: the round
        feeds them ahead of its block (one, the float model's own token, after a draft it took whole). A cache that is
        empty is prefilled, one that fell further behind (rounds switched off) catches up a block at a time."""
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
        """A catch-up forward, timed into the W8A8 cost fit: its long blocks give the fit the slope that prices the
        next catch-up (``RoundPolicy.rate``), which short rounds alone leave to extrapolation."""
        began = time.perf_counter()
        forward(block)
        self.policy.middle_cost.observe(len(block), time.perf_counter() - began)
