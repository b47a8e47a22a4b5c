"""Several sequences over one engine's weights: ``Engine.open`` and the backends' ``new_sequence``, interleaved step by step."""

from __future__ import annotations

import pytest

from quasar_deploy.api import load
from quasar_deploy.engine import Engine, GenerationOptions

PROMPTS = ["def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n", "import os\nimport sys\n", "class Counter:\n    def __init__(self):\n"]


@pytest.fixture(scope="module")
def engine(tiny_qwen3) -> Engine:
    return load(tiny_qwen3, backend="cpu")


def test_a_new_sequence_shares_the_weights_and_not_the_cache(engine):
    other = engine.lm.new_sequence()
    assert other.decoder is engine.lm.decoder and other.cache is not engine.lm.cache and other.length == 0


@pytest.mark.parametrize("draft", ["ngram", "layerskip", "none"])
def test_interleaved_generations_equal_each_alone(engine, draft):
    options = GenerationOptions(max_new_tokens=20, draft=draft)
    alone = [engine.generate(p, max_new_tokens=20, draft=draft).tokens for p in PROMPTS]
    own_length = engine.lm.length
    generations = [engine.open(engine.encode(p), options) for p in PROMPTS]
    running = [g.steps() for g in generations]
    while running:  # round-robin, one verify step each
        for steps in list(running):
            if next(steps, None) is None:
                running.remove(steps)
    assert [g.result.tokens for g in generations] == alone
    assert engine.lm.length == own_length  # the engine's own sequence was never touched


def test_closing_a_generation_early_leaves_no_result(engine):
    generation = engine.open(engine.encode(PROMPTS[0]), GenerationOptions(max_new_tokens=20))
    steps = generation.steps()
    next(steps)
    steps.close()
    assert next(steps, None) is None and generation.result is None
