"""The suffix drafter's proposals and the per-sequence draft length, against brute force and by hand.

Losslessness of both is tested with every other drafter (greedy: tests/test_speculative.py; sampled:
tests/test_spec_sampling.py); here: that they propose what they promise.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from quasar_deploy.errors import QuasarError
from quasar_deploy.speculative.acceptance import Sampler, SamplingParams
from quasar_deploy.speculative.draft_length import DraftLength
from quasar_deploy.speculative.loop import LoopStats
from quasar_deploy.speculative.suffix import SPEC_FACTOR, SuffixDrafter

from .helpers import MarkovLM, speculate

GREEDY = Sampler(SamplingParams())


def propose(tokens, k=5, **options):
    return SuffixDrafter(**options).propose(tokens, k, GREEDY).tokens


def test_suffix_copies_the_continuation_of_the_longest_context():
    # "1 2" occurred twice: followed by 3 then by 4; the longer context "9 1 2" picks the 4
    assert propose([9, 1, 2, 4, 5, 6, 1, 2, 3, 7, 9, 1, 2], k=3) == [4, 5, 6]
    assert propose([5, 6, 7], k=3) == []  # nothing repeats: no draft


def test_suffix_continues_a_repeating_pattern_past_the_text():
    assert propose([1, 2, 3, 1, 2, 3, 1], k=5) == [2, 3, 1, 2, 3]
    assert propose([4, 4, 4], k=3) == [4, 4, 4]


def test_suffix_drafts_at_most_spec_factor_tokens_per_matched_token():
    # "4" matched once (a match of one token) allows SPEC_FACTOR tokens, however certain its counts; a longer match more
    assert SPEC_FACTOR == 2
    assert propose([4, 4], k=16) == [4, 4]
    assert propose([4, 4, 4], k=16) == [4] * 4
    assert propose([4] * 10, k=16) == [4] * 16
    # a text seen once (every count one) repeated from its start: the match grows by one token per token emitted
    text = list(range(10, 30))
    assert [len(propose(text + text[:m], k=16)) for m in (1, 2, 3, 8)] == [2, 4, 6, 16]


def test_suffix_picks_the_most_frequent_continuation_then_the_latest():
    assert propose([1, 7, 1, 7, 1, 8, 1], k=1) == [7]  # 7 twice, 8 once
    assert propose([1, 7, 1, 8, 1], k=1) == [8]  # a tie: the latest


def test_suffix_stops_where_the_counts_make_the_next_token_unlikely():
    # after "1", 2 of 5 continuations are 7 (0.4), then "1 7" continues with 5 half the time (0.2 in all; 5 as the
    # latest of equals), and "1 7 5" was followed only by "1 2 1" (0.2 still)
    tokens = [1, 7, 9, 1, 7, 5, 1, 2, 1, 3, 1, 4, 1]
    # (a match of one token: SPEC_FACTOR tokens at most, unless the factor is lifted)
    assert propose(tokens, k=5, min_prob=0.3) == [7]
    assert propose(tokens, k=5, min_prob=0.1) == [7, 5]
    assert propose(tokens, k=5, min_prob=0.1, spec_factor=5) == [7, 5, 1, 2, 1]
    assert propose(tokens, k=3, min_prob=0.1, spec_factor=5) == [7, 5, 1]


def brute_force(tokens, k, min_prob, depth, spec_factor):
    """The drafter's rule from substring counts over the whole text: for each match length m, longest first, up to
    spec_factor * m of the most
    frequent (then latest) follower while the running probability holds, going on from the longest suffix of text and
    draft that has one where the walk runs out; the draft that expects the most kept tokens."""

    def followers(window):
        counts: Counter = Counter()
        latest = {}
        for end in range(len(window), len(tokens)):
            if tokens[end - len(window) : end] == window:
                counts[tokens[end]] += 1
                latest[tokens[end]] = end
        return counts, latest

    def anchor(text):
        for length in range(min(depth - 1, len(text)), 0, -1):
            if followers(text[len(text) - length :])[0]:
                return text[len(text) - length :]
        return None

    best, best_expected = [], 0.0
    for m in range(min(depth - 1, len(tokens)), 0, -1):
        window = list(tokens[len(tokens) - m :])
        if not followers(window)[0]:
            continue
        draft, chance, expected, most = [], 1.0, 0.0, min(k, spec_factor * m)
        while len(draft) < most:
            if len(window) >= depth or not followers(window)[0]:
                window = anchor(list(tokens) + draft)
                if window is None:
                    break
            counts, latest = followers(window)
            token = max(counts, key=lambda t: (counts[t], latest[t]))
            chance *= counts[token] / sum(counts.values())
            if chance < min_prob:
                break
            draft.append(token)
            expected += chance
            window = window + [token]
        if expected > best_expected:
            best, best_expected = draft, expected
            if expected >= most:
                break
    return best


def test_suffix_incremental_index_agrees_with_brute_force():
    rng = random.Random(5)
    for _ in range(40):
        min_prob, depth, factor = rng.choice([0.0, 0.1, 0.4]), rng.randint(3, 8), rng.choice([1, 2, 3])
        drafter, tokens = SuffixDrafter(min_prob, depth, factor), []
        for _ in range(rng.randint(1, 60)):
            tokens.append(rng.randrange(4))
            k = rng.randint(1, 6)
            assert drafter.propose(tokens, k, GREEDY).tokens == brute_force(tokens, k, min_prob, depth, factor), (tokens, k)


@pytest.mark.parametrize("min_prob", [-0.1, 1.0, "0.5", True])
def test_suffix_rejects_a_bad_probability_floor(min_prob):
    with pytest.raises(QuasarError, match="suffix_min_prob"):
        SuffixDrafter(min_prob)


def test_draft_length_follows_acceptance_within_its_bounds():
    fixed, adaptive = DraftLength(5, False), DraftLength(5, True)
    assert adaptive.k == fixed.k == 5
    for _ in range(6):
        fixed.observe(5, 0)
        adaptive.observe(adaptive.k, 0)
    assert fixed.k == 5 and adaptive.k == 1
    adaptive.observe(0, 0)  # nothing drafted: no news
    assert adaptive.k == 1
    for _ in range(10):
        adaptive.observe(adaptive.k, adaptive.k)
    assert adaptive.k == 5


def test_adaptive_k_verifies_fewer_rows_where_drafts_are_rejected():
    """A drafter whose every draft is wrong: fixed k verifies k of them a step, adaptive k soon one."""
    import torch

    lm = MarkovLM(torch.eye(4) * 50)  # greedy: each token repeats itself

    class Wrong:
        def propose(self, tokens, k, sampler):
            from quasar_deploy.speculative.drafters import Draft

            return Draft([(tokens[-1] + 1) % 4] * k)

    drafted = {}
    for adaptive in (False, True):
        stats = LoopStats()
        out = [t for step in speculate(lm, Wrong(), [2], GREEDY, 5, 30, (), stats, adaptive) for t in step]
        assert out == [2] * 30
        drafted[adaptive] = stats.drafted
    assert drafted[True] * 2 < drafted[False]


def test_a_generation_without_k_drafts_up_to_its_drafters_own():
    from quasar_deploy.engine import GenerationOptions

    assert GenerationOptions(draft="ngram").num_draft == 5  # the paper's k
    assert GenerationOptions(draft="suffix").num_draft == 16
    assert GenerationOptions(draft="suffix", num_draft=3).num_draft == 3
