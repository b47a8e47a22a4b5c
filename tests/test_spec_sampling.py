"""Sampling through the speculative loop has the verifier's distribution, whatever the drafter proposes.

Fixed seeds, small vocabularies, many trials, and a chi-square test of the
emitted tokens against the exact distribution. The same test must reject two
plausible wrong implementations (accepting every draft, and resampling from p
instead of the residual after a rejection), which shows it has the power to
catch a real bug.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import quasar_deploy.speculative.loop as loop
from quasar_deploy.artifact import open_model_files
from quasar_deploy.backends import create_backend
from quasar_deploy.serve.row_budget import RowBudget
from quasar_deploy.speculative.acceptance import Sampler, SamplingParams, Verdict
from quasar_deploy.speculative.drafters import Draft
from quasar_deploy.speculative.layerskip import LayerSkipDrafter
from quasar_deploy.speculative.loop import Speculation
from quasar_deploy.speculative.ngram import NgramDrafter
from quasar_deploy.speculative.output_cache import OutputCache
from quasar_deploy.speculative.suffix import SuffixDrafter

from .helpers import MarkovLM, chi_square_p_value, speculate

V = 4


class ShiftDrafter:
    """Deterministic proposals (each token + 1): the one-hot q case."""

    def propose(self, tokens, k, sampler):
        out = [tokens[-1]]
        for _ in range(k):
            out.append((out[-1] + 1) % V)
        return Draft(out[1:])


class MarkovDrafter:
    """Samples drafts from its own Markov table with the generation's sampler: the general q case."""

    def __init__(self, table):
        self.table = table

    def propose(self, tokens, k, sampler):
        tokens, probs = [tokens[-1]], []
        for _ in range(k):
            q = sampler.distribution(self.table[tokens[-1]])
            probs.append(q)
            tokens.append(sampler.sample(q))
        return Draft(tokens[1:], torch.stack(probs))


def blind_accept(logits, draft, draft_probs, sampler):
    probs = sampler.distribution(logits)
    return Verdict(len(draft), [*draft, sampler.sample(probs[len(draft)])])


def resample_from_p(logits, draft, draft_probs, sampler):
    probs = sampler.distribution(logits)
    for i, x in enumerate(draft):
        ratio = float(probs[i, x]) if draft_probs is None else float(probs[i, x] / draft_probs[i, x])
        if sampler.uniform() >= ratio:
            return Verdict(i, [*draft[:i], sampler.sample(probs[i])])
    return Verdict(len(draft), [*draft, sampler.sample(probs[len(draft)])])


TABLES = torch.randn(2, V, V, generator=torch.Generator().manual_seed(0)) * 1.5
PARAMS = {
    "plain": SamplingParams(temperature=1.0),
    "top_k": SamplingParams(temperature=0.8, top_k=3),
    "top_p": SamplingParams(temperature=1.2, top_p=0.7),
}


def markov_joint(params: SamplingParams, length: int) -> dict:
    """Exact probability of each sequence of ``length`` new tokens after the prompt [0]."""
    p = Sampler(params).distribution(TABLES[0])
    joint = {(): 1.0}
    for _ in range(length):
        joint = {seq + (b,): prob * float(p[seq[-1] if seq else 0, b]) for seq, prob in joint.items() for b in range(V)}
    return joint


def markov_samples(make_drafter, params: SamplingParams, trials: int, length: int = 4, k: int = 3, draft_length="fixed-k") -> Counter:
    """``trials`` generations, each with a fresh drafter from ``make_drafter`` (text-indexing drafters keep state); with
    ``draft_length`` "row-budget", each step's draft cut where a server's row budget would cut it."""
    sampler = Sampler(params, seed=1234)
    lm = MarkovLM(TABLES[0])
    counts: Counter = Counter()
    for _ in range(trials):
        speculation = Speculation(lm, make_drafter(), [0], sampler, k, length, adaptive_k=draft_length == "adaptive-k")
        steps = [speculation.prefill()]
        while not speculation.finished:
            block = speculation.draft()
            if draft_length == "row-budget":
                block = speculation.trim(BUDGET.keep(speculation.draft_length.rate, len(block) - 1))
            steps.append(speculation.settle(lm.verify(block), 0.0))
        counts[tuple(t for step in steps for t in step)] += 1
    return counts


# a server's row budget after forwards of one sequence, 1 to 10 rows at 10 ms a row, that emitted 2 tokens each: past
# the first, it computes a drafted token only where its estimated chance of acceptance is above about 0.36, so it cuts
# drafts by their past acceptance
BUDGET = RowBudget()
for rows in range(1, 11):
    BUDGET.observe(rows, 1, 0.01 * rows, 2)
assert 0.3 < BUDGET.threshold < 0.4
DRAFT_LENGTHS = ["fixed-k", "adaptive-k", "row-budget"]


# the opt-in cache of earlier outputs, as a server would hold it: drafts from it from the first step on
EARLIER_OUTPUTS = OutputCache(64)
for output in ([0, 1, 2, 3] * 4, [0, 0, 3, 1, 1, 2, 0, 3, 2, 2], [3, 2, 1, 0, 0, 1]):
    EARLIER_OUTPUTS.add(output)

# the prompt is [0] and the vocabulary 4 tokens, so the text-indexing drafters find matches from the second step on;
# 5 new tokens give them room to draft (the joint has 4**5 outcomes: more trials)
DRAFTERS = {
    "shift": (ShiftDrafter, 4, 1000),
    "markov": (lambda: MarkovDrafter(TABLES[1]), 4, 1000),
    "ngram": (NgramDrafter, 5, 2500),
    "suffix": (lambda: SuffixDrafter(min_prob=0.0), 5, 2500),
    "suffix-cache": (lambda: SuffixDrafter(min_prob=0.0, cache=EARLIER_OUTPUTS), 5, 2500),
}


@pytest.mark.parametrize("draft_length", DRAFT_LENGTHS)
@pytest.mark.parametrize("params", PARAMS)
@pytest.mark.parametrize("drafter", DRAFTERS)
def test_sampled_sequences_follow_the_verifier(drafter, params, draft_length):
    make, length, trials = DRAFTERS[drafter]
    counts = markov_samples(make, PARAMS[params], trials, length, draft_length=draft_length)
    assert chi_square_p_value(counts, markov_joint(PARAMS[params], length)) > 1e-3


@pytest.mark.parametrize("draft_length", DRAFT_LENGTHS)
@pytest.mark.parametrize("wrong", [blind_accept, resample_from_p])
@pytest.mark.parametrize("drafter", DRAFTERS)
def test_the_statistical_test_catches_wrong_acceptance(monkeypatch, wrong, drafter, draft_length):
    monkeypatch.setattr(loop, "accept", wrong)
    make, length, trials = DRAFTERS[drafter]
    counts = markov_samples(make, PARAMS["plain"], trials, length, draft_length=draft_length)
    assert chi_square_p_value(counts, markov_joint(PARAMS["plain"], length)) < 1e-6


# --- the real tiny model -------------------------------------------------------------

PROMPT = [17, 230, 1024]
REAL = SamplingParams(temperature=1.0, top_k=3)


@pytest.fixture(scope="module")
def lm(tiny_qwen3):
    return create_backend("cpu", open_model_files(tiny_qwen3))


@pytest.fixture(scope="module")
def real_joint(lm):
    """Exact probabilities of the first two new tokens, from the verifier's own forwards."""
    sampler = Sampler(REAL)
    first = sampler.distribution(lm.prefill(PROMPT))
    joint = {}
    for a in first.nonzero().flatten().tolist():
        second = sampler.distribution(lm.prefill([*PROMPT, a]))
        for b in second.nonzero().flatten().tolist():
            joint[(a, b)] = float(first[a] * second[b])
    return joint


class LikelyDrafter:
    """Deterministically proposes the verifier's most likely second token, so drafts are often but not always accepted."""

    def __init__(self, joint):
        self.best = {}
        for (a, b), prob in joint.items():
            if prob > self.best.get(a, (None, 0.0))[1]:
                self.best[a] = (b, prob)

    def propose(self, tokens, k, sampler):
        return Draft([self.best[tokens[-1]][0]])


def first_two(lm, make_drafter, trials):
    sampler = Sampler(REAL, seed=99)
    counts: Counter = Counter()
    for _ in range(trials):
        out: list[int] = []
        steps = speculate(lm, make_drafter(), PROMPT, sampler, 1, 3)
        while len(out) < 2:
            out += next(steps)
        steps.close()
        counts[tuple(out[:2])] += 1
    return counts


@pytest.mark.slow
def test_real_model_first_tokens_follow_the_verifier(lm, real_joint, monkeypatch):
    for make_drafter in (lambda: LikelyDrafter(real_joint), lambda: LayerSkipDrafter(lm, [1])):
        assert chi_square_p_value(first_two(lm, make_drafter, 200), real_joint) > 1e-3
    monkeypatch.setattr(loop, "accept", blind_accept)
    assert chi_square_p_value(first_two(lm, lambda: LikelyDrafter(real_joint), 100), real_joint) < 1e-6
