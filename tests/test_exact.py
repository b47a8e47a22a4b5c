"""Exact mode: the float model's own output, drafted through W8A8 rounds (speculative/cascade.py, exact.py).

Greedy output must equal the float model's own greedy decode, token for token; sampled output must follow
the float model's distribution (chi-square, with the same test rejecting wrong acceptance); both caches
must hold exactly the accepted prefix at every acceptance boundary; the adaptive round count must fall
back to plain float verification when W8A8 rounds cost more than they save.
"""

from __future__ import annotations

import json
import threading
from collections import Counter

import httpx
import pytest
import torch
from click.testing import CliRunner

import quasar_deploy.speculative.cascade as cascade
import quasar_deploy.speculative.loop as loop
from quasar_deploy.api import load
from quasar_deploy.cli import main
from quasar_deploy.engine import GenerationOptions
from quasar_deploy.errors import QuasarError
from quasar_deploy.exact_mode import ExactEngine
from quasar_deploy.serve.app import ServeConfig, create_app
from quasar_deploy.speculative.acceptance import Sampler, SamplingParams, Verdict
from quasar_deploy.speculative.cascade import CascadeDrafter, CascadeStats, RoundPolicy, StepCost, expected_tokens
from quasar_deploy.speculative.drafters import Draft, NoDrafter
from quasar_deploy.speculative.loop import Speculation
from quasar_deploy.speculative.ngram import NgramDrafter

from .helpers import FAST_CALIBRATION, MarkovLM, chi_square_p_value, copy_dir, reseal
from .serving import live_server

GREEDY = Sampler(SamplingParams())

# --- fake models: every prediction depends on the whole cached prefix ------------------------------------

V = 32


def truth(prefix: list[int]) -> int:
    """The float model's greedy next token after ``prefix`` (any stale or missing cache entry changes it)."""
    return hash(tuple(prefix)) % V


def reference(prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(truth(tokens))
    return tokens[len(prompt) :]


class Clock:
    """A fake ``time`` module: models advance it by their step cost, so the measured costs are the ones set."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


class PrefixLM:
    """A greedy CausalLM predicting ``truth`` of its whole cache; ``err_round`` i: the first row of the i-th verify since
    the float model's last one is wrong (a W8A8 model that disagrees there). ``check`` runs before each verify."""

    vocab_size = V
    max_length = 400

    def __init__(self, err_round: int | None = None, clock: Clock | None = None, cost: float = 0.0):
        self.ids: list[int] = []
        self.err_round, self.clock, self.cost = err_round, clock, cost
        self.round = 0
        self.check = lambda block: None

    def _row(self, wrong: bool) -> torch.Tensor:
        row = torch.zeros(V)
        row[(truth(self.ids) + wrong) % V] = 5.0
        return row

    def _tick(self) -> None:
        if self.clock is not None:
            self.clock.now += self.cost

    def prefill(self, ids):
        self.ids = list(ids)
        self._tick()
        return self._row(False)

    def verify(self, ids):
        self.check(ids)
        self.round += 1
        rows = []
        for i, token in enumerate(ids):
            self.ids.append(token)
            rows.append(self._row(i == 0 and self.round == self.err_round))
        self._tick()
        return torch.stack(rows)

    def truncate(self, length):
        del self.ids[length:]

    @property
    def length(self):
        return len(self.ids)


class ScriptedDrafter:
    """Proposes the float model's own continuation, made wrong at index ``wrong_at`` (None: never); records what it saw."""

    def __init__(self, wrong_at: int | None):
        self.wrong_at = wrong_at
        self.rewinds: list[int] = []
        self.seen: list[int] | None = None

    def rewind(self, length: int) -> None:
        assert not self.rewinds or length >= self.rewinds[-1], "rewind lengths never decrease"
        self.rewinds.append(length)

    def propose(self, tokens, k, sampler):
        self.seen = list(tokens)
        sequence, out = list(tokens), []
        for i in range(k):
            token = (truth(sequence) + 2 * (i == self.wrong_at)) % V
            sequence.append(token)
            out.append(token)
        return Draft(out)


def run_cascade(verifier, middle, inner, prompt, sampler, rounds, max_new_tokens, num_draft=3, stop_ids=()):
    """The loop exact mode runs (``ExactEngine.speculation``), over fake or real models."""
    stats = CascadeStats()
    drafter = CascadeDrafter(middle, inner, num_draft, stop_ids, RoundPolicy(rounds), stats)
    spec = Speculation(verifier, drafter, prompt, sampler, verifier.max_length, max_new_tokens, stop_ids, stats)
    return spec, stats


# --- cache rollback at every acceptance boundary ---------------------------------------------------------

PROMPT = [3, 1, 4, 1, 5]


def boundaries(rounds: int, err_round: int | None, wrong_at: int | None) -> set[str]:
    """What the float step must meet at least once: its acceptance of the draft (none, part, all)."""
    if rounds == 0:
        return {"none"} if wrong_at == 0 else {"part"} if wrong_at is not None else {"all"}
    return {"all"} if err_round is None else {"none"} if err_round == 1 else {"part"}


CASES = [(0, None, w) for w in (0, 2, None)] + [(r, e, w) for r in (1, 2, 3) for e in (None, *range(1, r + 1)) for w in (0, 2, None)]


@pytest.mark.parametrize("rounds,err_round,wrong_at", CASES)
def test_caches_hold_the_accepted_prefix_at_every_acceptance_boundary(rounds, err_round, wrong_at):
    verifier, middle, inner = PrefixLM(), PrefixLM(err_round), ScriptedDrafter(wrong_at)
    spec, stats = run_cascade(verifier, middle, inner, PROMPT, GREEDY, rounds, 60)
    drafted, kept, truncations = [], [], []

    def check_verifier(block):
        assert verifier.ids == spec.tokens[:-1] and block[0] == spec.tokens[-1]  # float cache: the sequence but its last token
        drafted.append(len(block) - 1)
        middle.round = 0  # the next W8A8 verify is a cycle's first round

    def check_middle(block):
        if inner.seen is not None:  # this round's proposal was made on a sequence that W8A8's cache and block must continue
            seen, cached = inner.seen, len(middle.ids)
            assert cached < len(seen) and middle.ids == seen[:cached] and block[: len(seen) - cached] == seen[cached:]
            inner.seen = None

    def recording_truncate(length, truncate=verifier.truncate):
        kept.append(length - len(spec.tokens))
        truncations.append(length)
        truncate(length)

    verifier.check, middle.check, verifier.truncate = check_verifier, check_middle, recording_truncate
    out = [t for step in spec.steps() for t in step]
    assert out == reference(PROMPT, 60)
    assert inner.rewinds[1:] == truncations[: len(inner.rewinds) - 1]  # the drafter rolled back to each accepted prefix
    met = {"none" if k == 0 else "all" if k == d else "part" for k, d in zip(kept, drafted) if d}
    assert boundaries(rounds, err_round, wrong_at) <= met, met
    if rounds:
        assert stats.middle_rounds >= stats.verify_steps - 1 and stats.direct_steps == 0
    else:
        assert stats.middle_rounds == 0 and stats.direct_steps >= stats.verify_steps - 1  # the last step may have no room to draft


def test_ngram_rewind_leaves_the_index_of_the_final_tokens():
    """After proposing on text that is then taken back, the n-gram drafter proposes as one that never saw it."""
    generator = torch.Generator().manual_seed(0)
    for _ in range(50):
        final = torch.randint(0, 5, (30,), generator=generator).tolist()
        taken_back = torch.randint(0, 5, (8,), generator=generator).tolist()
        replaced = torch.randint(0, 5, (8,), generator=generator).tolist()
        drafter, fresh = NgramDrafter(1, 3), NgramDrafter(1, 3)
        drafter.rewind(0)
        drafter.propose(final[:20], 4, GREEDY)
        drafter.rewind(20)
        drafter.propose(final + taken_back, 4, GREEDY)
        drafter.rewind(len(final))
        assert drafter.propose(final + replaced, 4, GREEDY) == fresh.propose(final + replaced, 4, GREEDY)


# --- sampled output: the float model's distribution ------------------------------------------------------

TABLES = torch.randn(2, 4, 4, generator=torch.Generator().manual_seed(0)) * 1.5
SAMPLED = {"plain": SamplingParams(temperature=1.0), "top_k": SamplingParams(temperature=0.8, top_k=3)}


def float_joint(params: SamplingParams, length: int) -> dict:
    """Exact probability of each sequence of ``length`` new tokens the float Markov model (TABLES[0]) samples after [0]."""
    p = Sampler(params).distribution(TABLES[0])
    joint = {(): 1.0}
    for _ in range(length):
        joint = {seq + (b,): prob * float(p[seq[-1] if seq else 0, b]) for seq, prob in joint.items() for b in range(4)}
    return joint


def cascade_samples(params: SamplingParams, rounds: int, trials: int, length: int = 4) -> Counter:
    sampler = Sampler(params, seed=4321)
    verifier, middle = MarkovLM(TABLES[0]), MarkovLM(TABLES[1])
    counts: Counter = Counter()
    for _ in range(trials):
        spec, _ = run_cascade(verifier, middle, NgramDrafter(1, 2), [0], sampler, rounds, length, num_draft=2)
        counts[tuple(t for step in spec.steps() for t in step)] += 1
    return counts


@pytest.mark.parametrize("params", SAMPLED)
@pytest.mark.parametrize("rounds", [1, 2])
def test_sampled_sequences_follow_the_float_model(params, rounds):
    counts = cascade_samples(SAMPLED[params], rounds, trials=1000)
    assert chi_square_p_value(counts, float_joint(SAMPLED[params], 4)) > 1e-3


def accept_every_draft(logits, draft, draft_probs, sampler):
    return Verdict(len(draft), [*draft, sampler.sample(sampler.distribution(logits)[len(draft)])])


def test_the_statistical_test_catches_a_float_step_that_keeps_w8a8_tokens_unjudged(monkeypatch):
    monkeypatch.setattr(loop, "accept", accept_every_draft)
    assert chi_square_p_value(cascade_samples(SAMPLED["plain"], 2, trials=1000), float_joint(SAMPLED["plain"], 4)) < 1e-6


def transition_counts(params: SamplingParams, rounds: int, trials: int, length: int = 16) -> Counter:
    """(token, next token) pairs of sampled generations: a Markov float model's output draws each next token from the
    row of its previous one, so every emitted token is a sample of a known distribution (far more power per trial)."""
    sampler = Sampler(params, seed=2468)
    verifier, middle = MarkovLM(TABLES[0]), MarkovLM(TABLES[1])
    counts: Counter = Counter()
    for _ in range(trials):
        spec, _ = run_cascade(verifier, middle, NgramDrafter(1, 2), [0], sampler, rounds, length, num_draft=2)
        sequence = [0, *(t for step in spec.steps() for t in step)]
        counts.update(zip(sequence, sequence[1:]))
    return counts


def transition_p_value(counts: Counter, params: SamplingParams) -> float:
    """Chi-square p-value of the transition counts against the float model's rows (each row's total taken as given)."""
    p = Sampler(params).distribution(TABLES[0])
    stat, cells = 0.0, 0
    for a in range(4):
        total = sum(counts[(a, b)] for b in range(4))
        for b in range(4):
            if p[a, b] == 0:
                if counts[(a, b)]:
                    return 0.0
                continue
            expected = total * float(p[a, b])
            stat += (counts[(a, b)] - expected) ** 2 / expected
            cells += 1
        cells -= 1  # each row's total is fixed
    return float(torch.special.gammaincc(torch.tensor(cells / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)))


@pytest.mark.parametrize("params", SAMPLED)
@pytest.mark.parametrize("rounds", [1, 3])
def test_every_sampled_token_follows_the_float_models_transition(params, rounds):
    assert transition_p_value(transition_counts(SAMPLED[params], rounds, trials=150), SAMPLED[params]) > 1e-3


WRONG_Q = {
    "uniform": lambda probs: torch.full_like(probs, 1 / probs.shape[-1]),  # as if W8A8's tokens were drawn uniformly
    "a position off": lambda probs: torch.roll(probs, 1, 0),  # each token judged against its neighbour's distribution
}


@pytest.mark.parametrize("wrong", WRONG_Q)
def test_the_transition_test_catches_a_wrong_draft_distribution(monkeypatch, wrong):
    """Power: the float step must judge W8A8's tokens against the distributions they were drawn from."""

    def propose(self, tokens, k, sampler, right=CascadeDrafter.propose):
        draft = right(self, tokens, k, sampler)
        return Draft(draft.tokens, WRONG_Q[wrong](draft.probs))

    monkeypatch.setattr(CascadeDrafter, "propose", propose)
    assert transition_p_value(transition_counts(SAMPLED["plain"], 3, trials=150), SAMPLED["plain"]) < 1e-6


# --- the round count: fixed, or chosen from measured costs -----------------------------------------------


def test_expected_tokens_is_the_accepted_prefix_plus_the_float_models_own():
    assert expected_tokens(4, 1.0) == 5
    assert expected_tokens(2, 0.5) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_tokens(0, 0.9) == 1


def test_step_costs_are_fitted_per_position():
    cost = StepCost()
    for positions in (1, 4, 2, 8, 6):
        cost.observe(positions, 0.1 + 0.02 * positions)
    assert cost(20) == pytest.approx(0.5)
    flat = StepCost()
    for _ in range(3):
        flat.observe(6, 0.3)
    assert flat(1) == flat(30) == pytest.approx(0.3)  # every forward the same length: no slope to fit


def policy_with(c: float, big_c: float, length: float, proposal: int, acceptance: float) -> RoundPolicy:
    """A policy that has measured W8A8 rounds of ``c`` s and float steps of ``big_c`` s at any length, ``length`` tokens kept
    per verify of ``proposal``-token proposals, and 20 float steps each keeping W8A8's tokens up to one rejection, at
    ``acceptance`` per token."""
    policy = RoundPolicy()
    assert policy.choose() == 1  # nothing measured: one round, to measure it
    policy.observe_proposal(proposal)
    policy.observe_round(1 + proposal, c, round(length))
    policy.tokens_per_verify = length
    kept = round(acceptance / (1 - acceptance))
    for _ in range(20):
        policy.observe_step(1 + proposal, big_c, kept, kept + 1, from_middle=True)
    assert policy.acceptance == pytest.approx(acceptance, abs=0.1)  # the prior still weighs a little
    return policy


def test_rounds_pay_where_w8a8_is_cheap_and_ngram_acceptance_low():
    # the design's example: c = C / 3, L = 1.4, the float model keeping 98.5% of W8A8's tokens
    policy = policy_with(1 / 3, 1.0, 1.4, 1, 0.985)
    assert policy.choose() >= 4
    assert policy.rate(4) / policy.rate(0) == pytest.approx(expected_tokens(5.6, policy.acceptance) / (4 / 3 + 1) / 1.4)
    assert policy.rate(4) > 1.5 * policy.rate(0)


def test_the_gain_at_another_acceptance_is_the_policys_own_speed_model():
    """bench's exact-mode figure at the paper's acceptance: the same model, from the costs and acceptance measured at
    the run's own (code-heavy: L = 2.8)."""
    policy = policy_with(0.5, 1.0, 2.8, 5, 0.985)
    at_paper = policy_with(0.5, 1.0, 1.4, 5, 0.985)  # the same costs and acceptance, measured at L = 1.4
    rounds, gain = policy.gain_at(1.4)
    assert rounds == at_paper.choose() > 0 and gain == pytest.approx(at_paper.rate(rounds) / at_paper.rate(0))
    assert policy.gain_at(2.8) == (policy.choose(), pytest.approx(policy.rate(policy.choose()) / policy.rate(0)))
    assert policy.tokens_per_verify == 2.8  # the policy's own estimate is left as measured
    assert policy_with(1.0, 1.0, 1.4, 5, 0.985).gain_at(1.4) == (0, 1.0)  # W8A8 no cheaper: no rounds
    assert RoundPolicy().gain_at(1.4) is None  # nothing measured yet


def test_rounds_fall_back_to_zero_where_they_do_not_pay():
    assert policy_with(1.0, 1.0, 2.8, 5, 0.985).choose() == 0  # W8A8 no cheaper than the float model
    assert policy_with(1 / 3, 1.0, 1.4, 1, 0.5).choose() == 0  # W8A8 too often overruled
    assert RoundPolicy(rounds=2).choose() == 2


def test_rounds_must_promise_the_margin_over_plain_verification(monkeypatch):
    """A predicted gain under ``ROUNDS_MARGIN`` is no gain: the estimates are noisy."""
    policy = policy_with(1 / 3, 1.0, 1.4, 1, 0.985)
    best = max(range(policy.max_rounds + 1), key=policy.rate)
    gain = policy.rate(best) / policy.rate(0)
    monkeypatch.setattr(cascade, "ROUNDS_MARGIN", gain * 1.01)
    assert policy.choose() == 0
    monkeypatch.setattr(cascade, "ROUNDS_MARGIN", gain * 0.99)
    assert policy.choose() == best


def test_rounds_charge_the_w8a8_caches_catch_up_to_the_tokens_left():
    policy = policy_with(1 / 3, 1.0, 1.4, 1, 0.985)  # rounds pay where W8A8's cache is up to date
    policy.middle_cost.observe(200, 100 / 3)  # with its 2-position rounds at 1/3 s: a W8A8 forward costs n / 6 s
    assert policy.middle_cost(2) == pytest.approx(1 / 3) and policy.middle_cost(200) == pytest.approx(100 / 3)
    assert policy.choose() >= 4
    assert policy.choose(behind=200, remaining=100_000) >= 4  # spread over a long generation, it is repaid
    assert policy.choose(behind=200, remaining=10) == 0  # 33 s to catch up, repaid by no 10 tokens


def test_a_catch_up_is_repaid_only_while_rounds_last():
    """Rounds switched on and off by the acceptance of the moment pay a catch-up each time they resume: it is spread over
    the proposals a run of rounds has lasted (``streak_length``), not over the whole generation left."""
    policy = policy_with(1 / 3, 1.0, 1.4, 1, 0.985)
    policy.middle_cost.observe(200, 100 / 3)
    assert [policy.choose() for _ in range(3)] == [policy.choose()] * 3 and policy.choose() >= 4
    assert policy.choose(behind=200, remaining=10) == 0  # ends a run of 5 proposals with rounds
    assert policy.streak_length == 5
    assert policy.choose(behind=30, remaining=100_000) >= 4  # 5 s to catch up over 5 proposals: still repaid
    assert policy.choose(behind=200, remaining=100_000) == 0  # 33 s over 5 proposals: not, however long the generation


def run_timed(monkeypatch, middle_cost: float, inner, n: int = 60):
    """A generation whose float step costs 1.0 and W8A8 round ``middle_cost`` of fake time (both loop and cascade read it)."""
    clock = Clock()
    monkeypatch.setattr(cascade, "time", clock)
    monkeypatch.setattr(loop, "time", clock)
    verifier, middle = PrefixLM(clock=clock, cost=1.0), PrefixLM(clock=clock, cost=middle_cost)
    spec, stats = run_cascade(verifier, middle, inner, PROMPT, GREEDY, None, n, num_draft=5)
    out = [t for step in spec.steps() for t in step]
    assert out == reference(PROMPT, n)
    run_timed.policy = spec.drafter.policy
    return stats


def test_adaptive_rounds_fall_back_to_plain_float_verification_when_w8a8_rounds_do_not_pay(monkeypatch):
    stats = run_timed(monkeypatch, 1.0, ScriptedDrafter(None))  # W8A8 no cheaper, drafts always right: rounds only cost
    assert stats.middle_rounds == 1  # the one round that measured it
    assert stats.direct_steps >= stats.verify_steps - 2


def test_a_policy_shared_by_generations_spares_the_next_one_rounds_that_do_not_pay(monkeypatch):
    """What one generation measured decides the next one's first proposals: no W8A8 round, no W8A8 prefill."""
    clock = Clock()
    monkeypatch.setattr(cascade, "time", clock)
    monkeypatch.setattr(loop, "time", clock)
    policy, counts = RoundPolicy(), []
    for _ in range(2):
        verifier, middle = PrefixLM(clock=clock, cost=1.0), PrefixLM(clock=clock, cost=1.0)  # W8A8 no cheaper
        prefills = []
        middle.prefill = lambda ids, middle=middle, prefills=prefills: prefills.append(ids) or PrefixLM.prefill(middle, ids)
        stats = CascadeStats()
        drafter = CascadeDrafter(middle, ScriptedDrafter(None), 5, (), policy, stats)
        spec = Speculation(verifier, drafter, PROMPT, GREEDY, verifier.max_length, 40, (), stats)
        assert [t for step in spec.steps() for t in step] == reference(PROMPT, 40)
        counts.append((stats.middle_rounds, len(prefills)))
    assert counts == [(1, 1), (0, 0)]  # the first measured W8A8 once; the second never touched it


def test_an_exact_engine_shares_its_chosen_rounds_policy_and_not_a_fixed_one(exact_engine):
    exact_engine.rounds = None
    assert exact_engine.round_policy() is exact_engine.round_policy()
    exact_engine.rounds = 2
    assert exact_engine.round_policy() is not exact_engine.round_policy() and exact_engine.round_policy().rounds == 2
    exact_engine.rounds = None


def test_adaptive_rounds_run_where_they_pay(monkeypatch):
    stats = run_timed(monkeypatch, 0.05, NoDrafter())  # nothing to draft from, W8A8 20x cheaper: it drafts
    assert stats.direct_steps == 0
    assert stats.middle_rounds > 3 * stats.verify_steps
    # every cost is the model's own here (the W8A8 prefill, charged apart, is left out of the cycles): the cycles with
    # rounds made at least what their predictions promised (more: the prior on a is cautious)
    realized = run_timed.policy.with_rounds
    assert run_timed.policy.efficiency == 1.0 and realized.made > realized.promised > 0


def test_the_w8a8_caches_catch_up_is_timed_into_its_cost_fit(monkeypatch):
    """The prefill of the W8A8 cache is one long forward: its time prices the next catch-up better than an extrapolation
    of short rounds would."""
    seen = []
    observe = StepCost.observe
    monkeypatch.setattr(StepCost, "observe", lambda self, n, s: (seen.append((self, n)), observe(self, n, s)))
    run_timed(monkeypatch, 0.05, NoDrafter(), n=12)
    middle = [n for cost, n in seen if cost is run_timed.policy.middle_cost]
    # the prefill (the prompt and the float model's first token: all but the pending one), then the rounds' blocks
    assert middle[0] == len(PROMPT) and all(n >= 1 for n in middle[1:])


def test_rounds_promising_more_than_they_made_are_scaled_back():
    """``efficiency``: costs the model leaves out (drafting, bookkeeping, a runtime waking after another's) show in the
    cycles' realized rate; a promise scaled by what earlier promises made must still clear the margin."""
    policy = policy_with(1 / 3, 1.0, 1.4, 1, 0.985)
    rounds = policy.choose()
    assert rounds >= 4 and policy.efficiency == 1.0
    gain = policy.rate(rounds) / policy.rate(0)
    for _ in range(10):  # each cycle made half its promise
        policy.observe_cycle(policy.rate(rounds), 5, 10 / policy.rate(rounds))
    assert policy.efficiency == pytest.approx(0.5)
    assert 0.5 * gain < cascade.ROUNDS_MARGIN and policy.choose() == 0
    assert policy.gain_at(1.4) == (0, 1.0)  # the bench's figure at the paper's acceptance carries it too
    for _ in range(200):  # later cycles made their promise: the old shortfall fades
        policy.observe_cycle(policy.rate(rounds), 10, 10 / policy.rate(rounds))
    assert policy.efficiency == pytest.approx(1.0, abs=0.01) and policy.choose() == rounds
    surplus = policy_with(1.0, 1.0, 1.4, 5, 0.985)  # rounds cannot pay here, and cycles that made more do not change that
    surplus.observe_cycle(1.0, 20, 10.0)
    assert surplus.efficiency == 1.0 and surplus.gain_at(1.4) == (0, 1.0) and surplus.choose() == 0


def test_rounds_must_beat_what_plain_float_steps_really_make():
    """``direct_efficiency``: plain float steps that make more than their predicted rate (a cost fit pulled by the longer
    float steps of cascade drafts overprices a short one) raise the bar rounds must clear; a shortfall does not lower it."""
    policy = policy_with(1 / 3, 1.0, 1.4, 1, 0.985)
    rounds = policy.choose()
    gain = policy.rate(rounds) / policy.rate(0)
    assert rounds >= 4 and policy.direct_efficiency == 1.0 and gain < 3
    for _ in range(10):  # each plain step made three times its prediction
        policy.observe_direct(policy.rate(0), 3, 1 / policy.rate(0))
    assert policy.direct_efficiency == pytest.approx(3.0) and policy.choose() == 0
    assert policy.gain_at(1.4) == (0, 1.0)
    short = policy_with(1 / 3, 1.0, 1.4, 1, 0.985)
    for _ in range(10):  # plain steps that made half: rounds are judged against the prediction, not against the shortfall
        short.observe_direct(short.rate(0), 1, 2 / short.rate(0))
    assert short.direct_efficiency == 1.0 and short.choose() == rounds


def test_plain_float_steps_are_checked_against_their_prediction(monkeypatch):
    """Each plain step whose rate was predicted reaches ``observe_direct``: its tokens, and the time of its float step and
    of the inner drafter's proposal."""
    seen = []
    monkeypatch.setattr(RoundPolicy, "observe_direct", lambda self, rate, tokens, s: seen.append((rate, tokens, s)))
    stats = run_timed(monkeypatch, 1.0, ScriptedDrafter(None))  # W8A8 no cheaper: plain steps after the first round
    assert len(seen) >= stats.direct_steps - 2 > 0
    assert all(rate > 0 and tokens >= 1 and s == pytest.approx(1.0) for rate, tokens, s in seen)  # one float step each


# --- the engine: both weight sets, the float model's output ----------------------------------------------

PROMPTS = [
    "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n",
    "The quick brown fox jumps over the lazy dog. The quick brown",
    "x = [1, 2, 3]\ny = [4, 5, 6]\nz = [",
    "Once upon a time",
]


@pytest.fixture(scope="module")
def float_engine(tiny_qwen3):
    return load(tiny_qwen3, backend="cpu")


@pytest.fixture(scope="module")
def exact_engine(tiny_artifact):
    return load(tiny_artifact.path, backend="cpu", verify="exact")


@pytest.fixture(scope="module")
def float_greedy(float_engine):
    return [float_engine.generate(p, max_new_tokens=40, draft="none").tokens for p in PROMPTS]


@pytest.mark.parametrize("rounds", [None, 0, 1, 3])
@pytest.mark.parametrize("draft", ["ngram", "none"])
def test_greedy_output_is_the_float_models_own(exact_engine, float_greedy, tiny_artifact, rounds, draft):
    w8a8 = load(tiny_artifact.path, backend="cpu")
    assert any(w8a8.generate(p, max_new_tokens=40, draft="none").tokens != f for p, f in zip(PROMPTS, float_greedy))
    exact_engine.rounds = rounds
    results = [exact_engine.generate(p, max_new_tokens=40, draft=draft) for p in PROMPTS]
    assert [r.tokens for r in results] == float_greedy
    if rounds:  # the float model overruled W8A8 somewhere: the rollbacks ran
        assert sum(r.stats.loop.middle_rounds for r in results) >= rounds * len(PROMPTS)
        assert any(r.stats.accepted < r.stats.drafted for r in results)


def test_a_draft_model_drafts_inside_the_cascade(exact_engine, float_greedy, tiny_llama):
    exact_engine.rounds = 2
    results = [exact_engine.generate(p, max_new_tokens=40, draft="model", draft_model=tiny_llama) for p in PROMPTS]
    assert [r.tokens for r in results] == float_greedy
    assert sum(r.stats.loop.middle_rounds for r in results) >= 2 * len(PROMPTS)


def test_a_seeded_sampled_generation_repeats_with_fixed_rounds(exact_engine):
    exact_engine.rounds = 2
    runs = [exact_engine.generate(PROMPTS[0], max_new_tokens=24, temperature=1.0, top_k=20, seed=7).tokens for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 24


def test_the_float_source_defaults_to_the_recorded_one_and_can_be_given(tiny_artifact, tiny_qwen3, tmp_path):
    engine = load(tiny_artifact.path, backend="cpu", verify="exact")
    assert isinstance(engine, ExactEngine) and engine.source == tiny_qwen3
    moved = copy_dir(tiny_artifact.path, tmp_path)
    record = json.loads((moved / "quasar.json").read_text())
    record["source"]["path"] = str(tmp_path / "gone")
    (moved / "quasar.json").write_text(json.dumps(record))
    reseal(moved)
    with pytest.raises(QuasarError, match="exact_source"):
        load(moved, backend="cpu", verify="exact")
    assert load(moved, backend="cpu", verify="exact", exact_source=tiny_qwen3).source == tiny_qwen3


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda art, model: load(model, verify="exact"), "not a float checkpoint"),
        (lambda art, model: load(art, verify="exact", exact_source=art), "must be the float checkpoint"),
        (lambda art, model: load(art, exact_source=model), "applies to verify='exact'"),
        (lambda art, model: load(art, verify="float"), "unknown verify mode"),
    ],
)
def test_exact_mode_refuses_what_it_cannot_run(tiny_artifact, tiny_qwen3, call, message):
    with pytest.raises(QuasarError, match=message):
        call(tiny_artifact.path, tiny_qwen3)


def test_exact_mode_refuses_a_drafter_that_cannot_take_back_a_draft(exact_engine):
    with pytest.raises(QuasarError, match="draft='layerskip' cannot draft for verify='exact'"):
        exact_engine.generate(PROMPTS[0], max_new_tokens=4, draft="layerskip", skip_layers=[1])
    with pytest.raises(QuasarError, match="draft='suffix' cannot draft for verify='exact'"):
        exact_engine.generate(PROMPTS[0], max_new_tokens=4, draft="suffix")
    with pytest.raises(QuasarError, match="adaptive_k applies to verify='model' here"):
        exact_engine.generate(PROMPTS[0], max_new_tokens=4, adaptive_k=True)
    assert exact_engine.generate(PROMPTS[0], max_new_tokens=4, adaptive_k=True, verify="model").tokens
    with pytest.raises(QuasarError, match="rounds must be an integer"):
        ExactEngine(exact_engine.lm, exact_engine.tokenizer, middle=exact_engine.middle, rounds=-1).generate(PROMPTS[0])


def test_requests_served_together_get_the_float_models_output(exact_engine, float_greedy):
    exact_engine.rounds = None
    texts = [exact_engine.tokenizer.decode(t, skip_special_tokens=True) for t in float_greedy]
    answers: list[str | None] = [None] * len(PROMPTS)
    with live_server(create_app(exact_engine, ServeConfig("tiny", max_sequences=len(PROMPTS)))) as base:

        def ask(i: int) -> None:
            body = {"model": "tiny", "prompt": PROMPTS[i], "max_tokens": 40, "temperature": 0}
            answers[i] = httpx.post(f"{base}/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert answers == texts


@pytest.fixture(scope="module")
def w8a8_greedy(tiny_artifact):
    w8a8 = load(tiny_artifact.path, backend="cpu")
    return [w8a8.generate(p, max_new_tokens=40, draft="none").tokens for p in PROMPTS]


def test_a_generation_may_ask_an_exact_engine_for_the_w8a8_models_own_output(exact_engine, float_greedy, w8a8_greedy):
    assert w8a8_greedy != float_greedy  # the two outputs differ on these prompts: the choice is visible
    for draft in ("ngram", "none"):
        assert [exact_engine.generate(p, max_new_tokens=40, draft=draft, verify="model").tokens for p in PROMPTS] == w8a8_greedy
    assert [exact_engine.generate(p, max_new_tokens=40, verify="exact").tokens for p in PROMPTS] == float_greedy
    options = GenerationOptions(verify="model")
    assert exact_engine.verifier(options) is exact_engine.middle and exact_engine.cached_models(options) == (exact_engine.middle,)
    assert exact_engine.cached_models(GenerationOptions()) == (exact_engine.lm, exact_engine.middle)


def test_a_plain_engine_refuses_exact_generations(tiny_artifact):
    engine = load(tiny_artifact.path, backend="cpu")
    with pytest.raises(QuasarError, match=r"verify='exact' needs the engine loaded for it: load\(artifact, verify='exact'\)"):
        engine.generate(PROMPTS[0], max_new_tokens=2, verify="exact")
    with pytest.raises(QuasarError, match="unknown verify mode 'float'"):
        engine.generate(PROMPTS[0], max_new_tokens=2, verify="float")


def test_requests_pick_the_float_or_the_w8a8_models_output_and_batch_apart(exact_engine, float_greedy, w8a8_greedy):
    """Half the requests ask for exact output, half for the W8A8 model's, all at once: each gets its own model's greedy
    text (the W8A8 blocks verify in a forward of their own), and each is what it would be alone."""
    exact_engine.rounds = None
    tokenizer = exact_engine.tokenizer
    asks = [(i, verify) for i in range(len(PROMPTS)) for verify in ("exact", "model")]
    answers: dict[tuple[int, str], str] = {}
    forwards = []
    batchers = {exact_engine.lm: "float", exact_engine.middle: "w8a8"}
    for lm, name in batchers.items():  # count the batched forwards of each model
        original = lm.verify_batch

        def counted(sequences, blocks, prefills=(), original=original, name=name):
            forwards.append(name)
            return original(sequences, blocks, prefills)

        lm.verify_batch = counted
    try:
        with live_server(create_app(exact_engine, ServeConfig("tiny", max_sequences=len(asks)))) as base:

            def ask(i: int, verify: str) -> None:
                body = {"model": "tiny", "prompt": PROMPTS[i], "max_tokens": 40, "temperature": 0, "verify": verify}
                answers[i, verify] = httpx.post(f"{base}/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]

            threads = [threading.Thread(target=ask, args=ask_) for ask_ in asks]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
    finally:
        for lm in batchers:
            del lm.verify_batch
    decode = lambda tokens: tokenizer.decode(tokens, skip_special_tokens=True)  # noqa: E731
    assert [answers[i, "exact"] for i in range(len(PROMPTS))] == [decode(t) for t in float_greedy]
    assert [answers[i, "model"] for i in range(len(PROMPTS))] == [decode(t) for t in w8a8_greedy]
    assert {"float", "w8a8"} <= set(forwards)


# --- command line --------------------------------------------------------------------------------------


def test_generate_verify_exact_prints_the_float_models_output(tiny_artifact, tiny_qwen3):
    common = ["--prompt", PROMPTS[0], "--max-new-tokens", "24", "--backend", "cpu", "--json"]
    plain = CliRunner().invoke(main, ["generate", str(tiny_qwen3), *common, "--draft", "none"])
    exact = CliRunner().invoke(main, ["generate", str(tiny_artifact.path), *common, "--verify", "exact", "--rounds", "2"])
    assert plain.exit_code == 0 and exact.exit_code == 0, plain.output + exact.output
    result = json.loads(exact.output)
    assert result["tokens"] == json.loads(plain.output)["tokens"]
    assert result["middle"].startswith("cpu W8A8") and result["backend"].startswith("cpu float")
    assert result["stats"]["middle_rounds"] >= 1


def test_the_command_lines_verify_choices_are_the_engines():
    from quasar_deploy.cli.generate import generate
    from quasar_deploy.engine import VERIFY_MODES

    assert tuple(next(p for p in generate.params if p.name == "verify").type.choices) == VERIFY_MODES


def test_exact_options_need_verify_exact(tiny_artifact):
    result = CliRunner().invoke(main, ["generate", str(tiny_artifact.path), "--prompt", "x", "--rounds", "2"])
    assert result.exit_code == 1 and "--rounds applies to --verify exact" in result.output


def test_doctor_reports_exact_memory_with_both_weight_sets(tiny_artifact):
    result = CliRunner().invoke(main, ["doctor", str(tiny_artifact.path), "--exact", "--json"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.output)
    exact = info["exact_memory"]
    assert exact["w8a8"]["total"] == info["memory"]["total"]
    assert exact["total"] == exact["float"]["total"] + exact["w8a8"]["total"] and exact["float"]["total"] > exact["w8a8"]["total"]


def test_bench_exact_mode_reports_its_step_costs_and_is_lossless(tiny_qwen3, tiny_artifact, tmp_path):
    args = ["bench", "e2e", str(tiny_artifact.path), "--reference", str(tiny_qwen3), "--limit", "2", "--max-new-tokens", "12"]
    result = CliRunner().invoke(main, [*args, "--modes", "ar-float,exact-ngram", "-o", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)["figures"]  # the result record (bench.record) holds the report as its figures
    assert "| exact-ngram |" in (tmp_path / "report.md").read_text().split("W8A8 round c ms")[1]
    assert report["lossless"] == {"exact-ngram == ar-float": True}
    figures = report["modes"]["exact-ngram"]
    assert figures["middle_rounds_per_step"] > 0 and figures["middle_round_ms"] > 0
    assert 0 <= figures["direct_step_share"] <= 1 and figures["verify_step_ms"] > 0


def test_auto_places_both_models_where_it_sends_the_float_one(tiny_artifact, tiny_qwen3, monkeypatch):
    """Where the CPU computes bf16 (faked here: the placement, not the numerics, is under test), auto sends the float
    checkpoint to the cpu backend and the artifact with it, though alone the artifact would go to ONNX Runtime; the
    output is still the float model's own."""
    pytest.importorskip("onnxruntime")
    from quasar_deploy.backends import registry

    # float checkpoints to the cpu backend (bf16), artifacts not (an int8 probe that picks a library kernel)
    monkeypatch.setattr(registry, "cpu_runs_better", lambda artifact: not artifact)
    assert load(tiny_artifact.path).lm.description.startswith("onnxruntime")  # the artifact alone
    exact = load(tiny_artifact.path, verify="exact")
    assert exact.lm.description.startswith("cpu float") and exact.middle.description.startswith("cpu W8A8")
    float_cpu = load(tiny_qwen3, backend="cpu")
    exact.rounds = 2
    for prompt in PROMPTS[:2]:
        assert exact.generate(prompt, max_new_tokens=24).tokens == float_cpu.generate(prompt, max_new_tokens=24, draft="none").tokens


def test_bench_exact_mode_with_onnx_runtime_drafting_is_lossless(tiny_qwen3, tiny_artifact, tmp_path):
    pytest.importorskip("onnxruntime")
    args = ["bench", "e2e", str(tiny_artifact.path), "--reference", str(tiny_qwen3), "--limit", "2", "--max-new-tokens", "12"]
    result = CliRunner().invoke(main, [*args, "--modes", "ar-float,exact-ngram-ort-draft", "-o", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)["figures"]  # stderr carries the exports' progress
    assert report["lossless"] == {"exact-ngram-ort-draft == ar-float": True}
    assert report["modes"]["exact-ngram-ort-draft"]["verify_step_ms"] > 0


def test_exact_mode_on_onnx_runtime_is_the_float_graphs_own_output(tiny_artifact, tiny_qwen3):
    pytest.importorskip("onnxruntime")
    float_ort = load(tiny_qwen3, backend="onnxruntime")
    exact = load(tiny_artifact.path, backend="onnxruntime", verify="exact")
    assert exact.lm.description.startswith("onnxruntime") and "W8A8" in exact.middle.description
    exact.rounds = 2
    for prompt in PROMPTS[:2]:
        assert exact.generate(prompt, max_new_tokens=24).tokens == float_ort.generate(prompt, max_new_tokens=24, draft="none").tokens


@pytest.mark.slow
def test_a_trained_models_greedy_output_on_the_built_in_prompts(tmp_path):
    """The shipped model with planted outliers and its artifact: exact mode reproduces the float greedy decode of every
    built-in benchmark prompt, where the W8A8 model's own output departs from it."""
    from quasar_deploy import calibrate, demo
    from quasar_deploy.bench.e2e import read_prompts
    from quasar_deploy.calibration.data import BUILTIN

    prompts = read_prompts(BUILTIN["prompts"], limit=100)
    model = demo.demo_model_path("outlier")
    artifact = calibrate(model, tmp_path / "w8a8", **FAST_CALIBRATION).path
    float_engine, w8a8 = load(model, backend="cpu"), load(artifact, backend="cpu")
    exact = load(artifact, backend="cpu", verify="exact")
    expected = [float_engine.generate(p, max_new_tokens=64, draft="none").tokens for p in prompts]
    assert any(w8a8.generate(p, max_new_tokens=64).tokens != e for p, e in zip(prompts, expected))
    for rounds in (None, 2):
        exact.rounds = rounds
        assert [exact.generate(p, max_new_tokens=64).tokens for p in prompts] == expected
