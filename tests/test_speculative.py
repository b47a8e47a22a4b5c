"""The speculative loop is lossless under greedy decoding, for every drafter, on float and W8A8 verifiers.

The oracle is the verifier's own autoregressive greedy decode (prefill, then one
token per forward). Drafters that always hit and always miss pin down both ends
of the acceptance logic; the real drafters cover everything in between.
"""

from __future__ import annotations

import random

import pytest
import torch

from quasar_deploy.artifact import open_model_files
from quasar_deploy.backends import create_backend
from quasar_deploy.backends.torch_backend import TorchCausalLM
from quasar_deploy.errors import QuasarError
from quasar_deploy.speculative.acceptance import Sampler, SamplingParams, accept
from quasar_deploy.speculative.draft_model import ModelDrafter
from quasar_deploy.speculative.drafters import Draft, NoDrafter
from quasar_deploy.speculative.layerskip import LayerSkipDrafter, skip_order
from quasar_deploy.speculative.loop import LoopStats
from quasar_deploy.speculative.ngram import NgramDrafter
from quasar_deploy.speculative.suffix import SuffixDrafter

from .helpers import greedy as greedy_reference
from .helpers import speculate
from .tiny import naive_w8a8_decoder

GREEDY = SamplingParams()


def run(lm, drafter, prompt, k=5, n=40, stop_ids=(), sampler=None, adaptive_k=False):
    stats = LoopStats()
    steps = list(speculate(lm, drafter, prompt, sampler or Sampler(GREEDY), k, n, stop_ids, stats, adaptive_k))
    return [t for step in steps for t in step], stats, steps


class OracleDrafter:
    """Proposes the true greedy continuation: every draft must be accepted."""

    def __init__(self, full: list[int]):
        self.full = full

    def propose(self, tokens, k, sampler):
        return Draft(self.full[len(tokens) : len(tokens) + k])


class WrongDrafter(OracleDrafter):
    """Proposes the true continuation shifted by one id: every draft must be rejected."""

    def propose(self, tokens, k, sampler):
        return Draft([(t + 1) % 4096 for t in super().propose(tokens, k, sampler).tokens])


@pytest.fixture(scope="module")
def verifiers(tiny_qwen3):
    return {"float": create_backend("cpu", open_model_files(tiny_qwen3)), "w8a8": TorchCausalLM(naive_w8a8_decoder(tiny_qwen3))}


@pytest.fixture(scope="module")
def draft_lm(tiny_llama):
    return create_backend("cpu", open_model_files(tiny_llama))


def prompts(seed: int) -> list[list[int]]:
    """Random prompts, of length 1 and with repeats (so n-gram drafts hit)."""
    rng = random.Random(seed)
    out = [[rng.randrange(4096)]]
    for _ in range(2):
        base = [rng.randrange(4096) for _ in range(rng.randint(2, 20))]
        out.append(base * rng.randint(1, 2))
    return out


def make_drafter(name, lm, draft_lm, full):
    return {
        "none": lambda: NoDrafter(),
        "ngram": lambda: NgramDrafter(),
        "ngram2": lambda: NgramDrafter(2, 2),
        "suffix": lambda: SuffixDrafter(),
        "suffix0": lambda: SuffixDrafter(min_prob=0.0),
        "layerskip": lambda: LayerSkipDrafter(lm, [1]),
        "model": lambda: ModelDrafter(draft_lm, lm.vocab_size),
        "oracle": lambda: OracleDrafter(full),
        "wrong": lambda: WrongDrafter(full),
    }[name]()


@pytest.mark.parametrize("kind", ["float", "w8a8"])
# adaptive k on the model-free drafters and the two extremes (all accepted, none)
@pytest.mark.parametrize(
    "name,adaptive_k",
    [(name, False) for name in ("none", "ngram", "ngram2", "suffix", "suffix0", "layerskip", "model", "oracle", "wrong")]
    + [(name, True) for name in ("ngram", "suffix", "oracle", "wrong")],
)
def test_greedy_matches_the_verifier(verifiers, draft_lm, kind, name, adaptive_k):
    lm = verifiers[kind]
    for i, prompt in enumerate(prompts(seed=sum(map(ord, kind + name)))):
        n = (6, 30, 20)[i]
        expected = greedy_reference(lm, prompt, n)
        for k in (1,) if name == "none" else (1, 4):
            drafter = make_drafter(name, lm, draft_lm, prompt + expected)
            got, stats, steps = run(lm, drafter, prompt, k=k, n=n, adaptive_k=adaptive_k)
            assert got == expected, (name, kind, k, prompt)
            assert stats.verify_steps == len(steps) - 1 and sum(map(len, steps)) == n  # the prefill emits the first token
            assert lm.length == len(prompt) + n - 1  # the last token stays pending
            assert stats.accepted == sum(len(s) - 1 for s in steps[1:])
            if name == "oracle":
                assert stats.accepted == stats.drafted and stats.verify_steps == -(-(n - 1) // (k + 1))
            if name == "wrong":
                assert stats.accepted == 0 and stats.drafted > 0
            if name == "none":
                assert stats.drafted == 0 and stats.verify_steps == n - 1


def test_drafters_actually_draft(verifiers, draft_lm):
    """On a repetitive prompt every real drafter gets tokens accepted (else the tests above prove little)."""
    lm = verifiers["float"]
    prompt = list(range(100, 112)) * 3
    for drafter in (NgramDrafter(), SuffixDrafter(), LayerSkipDrafter(lm, [1]), ModelDrafter(draft_lm, lm.vocab_size)):
        _, stats, _ = run(lm, drafter, prompt, k=4, n=40)
        assert stats.drafted > 0
    for drafter in (NgramDrafter(), SuffixDrafter()):
        _, stats, _ = run(lm, drafter, prompt, k=4, n=40)
        assert stats.accepted > 10


def test_layerskip_drafts_from_the_accepted_prefix(verifiers, tiny_qwen3):
    """Each layer-skip draft equals a from-scratch computation: full-model cache for the prefix, skipped layers after."""
    lm = verifiers["float"]
    fresh = create_backend("cpu", open_model_files(tiny_qwen3))
    skip = frozenset({0, 2})

    class Checked(LayerSkipDrafter):
        calls = 0

        def propose(self, tokens, k, sampler):
            length = lm.length
            draft = super().propose(tokens, k, sampler)
            assert lm.length == length
            fresh.prefill(tokens[:-1])
            expected, token = [], tokens[-1]
            for _ in range(k):
                token = int(fresh.verify_skipping([token], skip)[-1].argmax())
                expected.append(token)
            assert draft.tokens == expected
            Checked.calls += 1
            return draft

    prompt = [5, 6, 7, 8, 9, 5, 6]
    got, _, _ = run(lm, Checked(lm, skip), prompt, k=3, n=20)
    assert got == greedy_reference(lm, prompt, 20) and Checked.calls > 3


def test_model_drafter_rolls_its_cache_back(verifiers, tiny_llama):
    """After rejections, the draft model's proposals equal its own greedy decode of the accepted text."""
    lm = verifiers["float"]
    draft_backend = create_backend("cpu", open_model_files(tiny_llama))
    fresh = create_backend("cpu", open_model_files(tiny_llama))
    calls = []

    class Checked(ModelDrafter):
        def propose(self, tokens, k, sampler):
            draft = super().propose(tokens, k, sampler)
            assert draft.tokens == greedy_reference(fresh, list(tokens), k)
            calls.append(len(tokens))
            return draft

    prompt = list(range(300, 310)) * 2
    got, stats, _ = run(lm, Checked(draft_backend, lm.vocab_size), prompt, k=4, n=30)
    assert got == greedy_reference(lm, prompt, 30)
    assert len(calls) > 3 and stats.accepted < stats.drafted  # some rejections happened


def test_model_drafter_fits_a_different_vocabulary_size(verifiers, draft_lm):
    """A draft model with fewer logits than the verifier is padded, with more it is cut: q lines up with p."""
    drafter = ModelDrafter(draft_lm, vocab_size=5000)
    draft = drafter.propose([1, 2, 3], 3, Sampler(SamplingParams(temperature=1.0), seed=0))
    assert draft.probs.shape == (3, 5000) and float(draft.probs[:, 4096:].sum()) == 0
    drafter = ModelDrafter(draft_lm, vocab_size=100)
    draft = drafter.propose([1, 2, 3], 3, Sampler(GREEDY))
    assert all(t < 100 for t in draft.tokens)


def test_stop_ids_end_generation_and_are_emitted(verifiers):
    lm = verifiers["float"]
    prompt = [11, 12, 13, 11, 12]
    expected = greedy_reference(lm, prompt, 30)
    stop = expected[9]
    cut = expected[: expected.index(stop) + 1]
    for drafter in (NoDrafter(), OracleDrafter(prompt + expected)):
        got, _, _ = run(lm, drafter, prompt, k=5, n=30, stop_ids={stop})
        assert got == cut


def test_context_window_ends_generation_like_plain_decoding(tiny_qwen3):
    lm = create_backend("cpu", open_model_files(tiny_qwen3))
    lm.max_length = 24
    prompt = [3, 4, 5, 3, 4, 5, 3, 4]
    expected = greedy_reference(lm, prompt, 100)
    assert len(prompt) + len(expected) == 24
    for drafter in (NoDrafter(), OracleDrafter(prompt + expected), NgramDrafter()):
        got, _, _ = run(lm, drafter, prompt, k=5, n=100)
        assert got == expected
    with pytest.raises(QuasarError, match="context window is 24"):
        speculate(lm, NoDrafter(), list(range(24)), Sampler(GREEDY), 5, 10)


@pytest.mark.parametrize(
    "prompt,k,n,message",
    [([], 5, 10, "prompt is empty"), ([1], -1, 10, "draft tokens must be an integer >= 0"), ([1], 2, 0, "max_new_tokens")],
)
def test_bad_loop_arguments_raise_before_any_work(verifiers, prompt, k, n, message):
    with pytest.raises(QuasarError, match=message):
        speculate(verifiers["float"], NoDrafter(), prompt, Sampler(GREEDY), k, n)


def test_num_draft_zero_is_plain_decoding(verifiers):
    lm = verifiers["float"]
    got, stats, _ = run(lm, NgramDrafter(), [1, 2, 1, 2, 1], k=0, n=12)
    assert got == greedy_reference(lm, [1, 2, 1, 2, 1], 12) and stats.drafted == 0


# --- n-gram drafter -------------------------------------------------------------


def propose(tokens, k=5, **kw):
    return NgramDrafter(**kw).propose(tokens, k, Sampler(GREEDY)).tokens


def test_ngram_copies_what_followed_with_overlap():
    assert propose([1, 2, 3, 4, 1, 2]) == [3, 4, 1, 2, 3]  # past the end it copies its own draft
    assert propose([9, 9]) == [9, 9, 9, 9, 9]
    assert propose([1, 2, 3]) == []
    assert propose([7], k=3) == []


def test_ngram_prefers_the_longest_match_then_the_latest():
    assert propose([7, 1, 9, 5, 1, 8, 7, 1], k=1) == [9]  # bigram (7, 1) beats the later unigram (1,)
    assert propose([1, 2, 1, 3, 1], k=2) == [3, 1]  # latest occurrence of (1,)
    assert propose([7, 1, 9, 5, 1, 8, 7, 1], k=1, ngram_max=1) == [8]
    assert propose([1, 2, 3, 1], k=2, ngram_min=2) == []


def brute_force(tokens, k, ngram_min, ngram_max):
    for n in range(min(ngram_max, len(tokens)), ngram_min - 1, -1):
        suffix = tokens[-n:]
        for end in range(len(tokens) - 1, n - 1, -1):
            if tokens[end - n : end] == suffix:
                seq = list(tokens)
                for j in range(k):
                    seq.append(seq[end + j])
                return seq[len(tokens) :]
    return []


def test_ngram_incremental_index_agrees_with_a_full_rescan():
    rng = random.Random(0)
    for _ in range(30):
        ngram_min = rng.randint(1, 2)
        ngram_max = rng.randint(ngram_min, 4)
        drafter = NgramDrafter(ngram_min, ngram_max)
        tokens = [rng.randrange(4) for _ in range(rng.randint(1, 5))]
        for _ in range(25):
            k = rng.randint(1, 6)
            assert drafter.propose(tokens, k, Sampler(GREEDY)).tokens == brute_force(tokens, k, ngram_min, ngram_max)
            tokens += [rng.randrange(4) for _ in range(rng.randint(1, 4))]


@pytest.mark.parametrize("ngram_min,ngram_max", [(0, 3), (3, 2), (1.5, 3)])
def test_ngram_rejects_bad_ranges(ngram_min, ngram_max):
    with pytest.raises(QuasarError, match="ngram_m"):
        NgramDrafter(ngram_min, ngram_max)


# --- layer-skip choice ----------------------------------------------------------------


def test_skip_order_finds_the_best_single_layer(verifiers):
    lm = verifiers["float"]
    ids = list(range(200, 260))
    lm.truncate(0)
    target = lm.verify(ids).argmax(-1)

    def agreement(layer):
        lm.truncate(0)
        return float((lm.verify_skipping(ids, frozenset({layer})).argmax(-1) == target).float().mean())

    best = max(agreement(layer) for layer in range(3))
    (chosen,) = skip_order(lm, ids, 1)
    assert agreement(chosen) == best
    assert len(set(skip_order(lm, ids, 2))) == 2
    with pytest.raises(QuasarError, match="between 1 and 2"):
        skip_order(lm, ids, 3)


def test_a_longer_skip_choice_continues_a_shorter_one(verifiers, monkeypatch):
    lm = verifiers["float"]
    ids = list(range(200, 260))
    first, second = skip_order(lm, ids, 2)
    assert skip_order(lm, ids, 1) == (first,) and first != second
    forwards = []
    run = lm.verify_skipping
    monkeypatch.setattr(lm, "verify_skipping", lambda ids, skip: forwards.append(skip) or run(ids, skip))
    assert skip_order(lm, ids, 2, picked=(first,)) == (first, second)
    assert len(forwards) == 1 + 2  # the full model's targets, then the two layers left; from scratch: 1 + 3 + 2
    assert skip_order(lm, ids, 1, picked=(first, second)) == (first,) and len(forwards) == 3  # a prefix costs nothing


@pytest.mark.parametrize("layers,message", [([3], "layer 3 does not exist"), ([0, 1, 2], "between 1 and 2"), ([], "between 1 and 2")])
def test_layerskip_rejects_bad_layers(verifiers, layers, message):
    with pytest.raises(QuasarError, match=message):
        LayerSkipDrafter(verifiers["float"], layers)


def test_layerskip_needs_a_backend_that_can_skip():
    class Graph:
        description = "onnxruntime graph"

        def verify(self, ids):
            raise AssertionError

    with pytest.raises(QuasarError, match="cannot skip layers"):
        LayerSkipDrafter(Graph(), [1])


# --- acceptance rules ------------------------------------------------------------------


def one_hot_logits(targets: list[int], vocab: int = 8) -> torch.Tensor:
    logits = torch.zeros(len(targets), vocab)
    logits[torch.arange(len(targets)), targets] = 5.0
    return logits


def test_greedy_acceptance_keeps_the_matching_prefix_and_adds_the_verifiers_token():
    logits = one_hot_logits([3, 4, 5, 6])
    greedy = Sampler(GREEDY)
    assert accept(logits, [3, 4, 5], None, greedy).tokens == [3, 4, 5, 6]
    assert accept(logits, [3, 1, 5], None, greedy).tokens == [3, 4]
    verdict = accept(logits, [0, 4, 5], None, greedy)
    assert (verdict.accepted, verdict.tokens) == (0, [3])
    assert accept(logits[:1], [], None, greedy).tokens == [3]


def test_sampling_distribution_matches_transformers_warpers():
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 3
    for temperature, top_k, top_p in [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.9, 10, 0.5), (1.0, 0, 1e-6)]:
        expected = TemperatureLogitsWarper(temperature)(None, logits.clone())
        if top_k:
            expected = TopKLogitsWarper(top_k)(None, expected)
        if top_p < 1:
            expected = TopPLogitsWarper(top_p)(None, expected)
        got = Sampler(SamplingParams(temperature, top_k, top_p)).distribution(logits)
        torch.testing.assert_close(got, torch.softmax(expected, -1), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(
    "params,message",
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=1.0, top_p=0.0), r"top_p must be in \(0, 1\]"),
        (dict(temperature=1.0, top_p=1.5), r"top_p must be in \(0, 1\]"),
        (dict(temperature=1.0, top_k=-2), "top_k"),
    ],
)
def test_bad_sampling_parameters(params, message):
    with pytest.raises(QuasarError, match=message):
        SamplingParams(**params)


def test_sampling_is_reproducible_with_a_seed(verifiers, draft_lm):
    lm = verifiers["float"]
    params = SamplingParams(temperature=1.0, top_k=50)

    def sample(seed, drafter):
        return run(lm, drafter, [4, 5, 6, 4, 5], k=3, n=25, sampler=Sampler(params, seed))[0]

    assert sample(3, NgramDrafter()) == sample(3, NgramDrafter())
    assert sample(3, ModelDrafter(draft_lm, 4096)) == sample(3, ModelDrafter(draft_lm, 4096))
    assert sample(3, NgramDrafter()) != sample(4, NgramDrafter())
