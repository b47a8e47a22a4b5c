"""The opt-in cache of earlier outputs that suffix drafts copy across generations: what it proposes, that the oldest
outputs leave with their counts, that drafting from it stays lossless, and that a server keeps one only when asked."""

from __future__ import annotations

import random

import pytest
import torch

from quasar_deploy.errors import QuasarError
from quasar_deploy.speculative.acceptance import Sampler, SamplingParams
from quasar_deploy.speculative.drafters import NoDrafter
from quasar_deploy.speculative.loop import LoopStats
from quasar_deploy.speculative.output_cache import OutputCache
from quasar_deploy.speculative.suffix import SuffixDrafter

from .helpers import MarkovLM, speculate

GREEDY = Sampler(SamplingParams())


def shape(node) -> dict:
    """The counts of a tree, as nested dicts: what a tree of the same outputs must equal, whatever the order it grew in."""
    return {token: (child.count, child.continued, shape(child)) for token, child in node.children.items()}


def test_a_suffix_draft_copies_what_an_earlier_output_continued():
    cache = OutputCache(1000)
    cache.add(list(range(10, 40)))
    prompt = [1, 2, 10, 11, 12]  # nothing in the prompt repeats: without the cache, no draft
    assert SuffixDrafter().propose(prompt, 16, GREEDY).tokens == []
    # three matched tokens allow six drafted (suffix.SPEC_FACTOR per matched token)
    assert SuffixDrafter(cache=cache).propose(prompt, 16, GREEDY).tokens == list(range(13, 19))
    assert SuffixDrafter(cache=cache).propose([*prompt, *range(13, 20)], 16, GREEDY).tokens == list(range(20, 36))


def test_the_oldest_outputs_leave_with_their_counts():
    rng = random.Random(3)
    for _ in range(30):
        cache = OutputCache(rng.randint(5, 40), depth=rng.randint(2, 6))
        outputs = [[rng.randrange(4) for _ in range(rng.randint(1, 15))] for _ in range(rng.randint(1, 8))]
        for output in outputs:
            cache.add(output)
        kept, held = [], 0
        for output in reversed(outputs):  # the newest that fit, an output longer than the cap by its end
            output = output[-cache.max_tokens :]
            if held + len(output) > cache.max_tokens:
                break
            kept.insert(0, output)
            held += len(output)
        fresh = OutputCache(cache.max_tokens, depth=cache.depth)
        for output in kept:
            fresh.add(output)
        assert cache.tokens == fresh.tokens == held
        assert shape(cache._root) == shape(fresh._root)
        stack = [cache._root]
        while stack:  # each node's pick is one of its most frequent children
            node = stack.pop()
            assert (node.best is None) == (not node.children)
            if node.best is not None:
                assert node.best[1].count == max(child.count for child in node.children.values())
            stack.extend(node.children.values())


def test_drafting_from_the_cache_keeps_the_verifiers_output():
    table = torch.randn(6, 6) * 3
    lm = MarkovLM(table)
    plain = [t for step in speculate(lm, NoDrafter(), [2], GREEDY, 16, 40, (), LoopStats()) for t in step]
    cache = OutputCache(100)
    cache.add(plain[:20])  # the same text: long drafts, mostly kept
    cache.add([(t + 1) % 6 for t in plain])  # other text: drafts rejected
    stats = LoopStats()
    drafted = [t for step in speculate(MarkovLM(table), SuffixDrafter(cache=cache), [2], GREEDY, 16, 40, (), stats) for t in step]
    assert drafted == plain
    assert stats.drafted > 0


@pytest.mark.parametrize("max_tokens", [0, -1, 1.5, True])
def test_a_cache_holds_at_least_one_token(max_tokens):
    with pytest.raises(QuasarError, match="at least 1 token"):
        OutputCache(max_tokens)


def test_a_server_keeps_outputs_only_when_asked(tiny_qwen3):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from quasar_deploy.api import load
    from quasar_deploy.serve.app import ServeConfig, create_app

    body = {"model": "tiny", "prompt": "def fib(n):", "max_tokens": 8, "temperature": 0, "draft": "suffix"}
    engine = load(tiny_qwen3, backend="cpu")
    with TestClient(create_app(engine, ServeConfig("tiny"))) as client:
        assert client.post("/v1/completions", json=body).status_code == 200
    assert engine.output_cache is None
    with TestClient(create_app(engine, ServeConfig("tiny", suffix_cache_tokens=100))) as client:
        assert client.post("/v1/completions", json=body).status_code == 200
        assert client.post("/v1/completions", json={**body, "draft": "ngram"}).status_code == 200
    assert engine.output_cache.tokens == 16  # both outputs, whichever drafter made them
    create_app(engine, ServeConfig("tiny"))
    assert engine.output_cache is None  # the same engine served again without the flag shares nothing
