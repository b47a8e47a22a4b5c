"""Batched verify steps: many sequences' blocks in one forward, each row computed exactly as alone (batch invariance)."""

from __future__ import annotations

import queue
import threading
import time

import pytest
import torch

from quasar_deploy.api import load
from quasar_deploy.cpu.linears import float_linear, onednn_available
from quasar_deploy.engine import Engine
from quasar_deploy.serve import scheduler
from quasar_deploy.serve.metrics import Metrics
from quasar_deploy.serve.protocol import Request
from quasar_deploy.serve.scheduler import Done, Failed, Scheduler, Ticket
from quasar_deploy.speculative.causal_lm import BatchVerifyingLM

from .helpers import skip_without_bf16
from .serving import slow_engine

pytestmark = pytest.mark.skipif(not onednn_available(), reason="batched steps need the row-invariant oneDNN float kernel")

PROMPTS = [
    "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n",
    "import os\nimport sys\n",
    "class Counter:\n    def __init__(self):\n",
    "The quick brown fox jumps over the lazy dog. The quick brown",
    "for i in range(10):\n    print(i)\nfor i in range(",
    "x = [1, 2, 3]\ny = [4, 5, 6]\nz = [",
    "Once upon a time",
    "SELECT name FROM users WHERE id = 1;\nSELECT name FROM",
]


@pytest.fixture(scope="module", params=["w8a8", "float", "w8a8-bf16", "float-bf16", "w8a8-onnxruntime"])
def engine(request, tiny_artifact, tiny_qwen3) -> Engine:
    """Each model in float32, and in bf16 as a bf16 CPU runs it (a W8A8 model's head, a float model wholly): batch
    invariance must hold for both dtypes; and a W8A8 model as ONNX Runtime's layer graphs (what serving asks of it)."""
    path = tiny_artifact.path if request.param.startswith("w8a8") else tiny_qwen3
    if request.param.endswith("onnxruntime"):
        pytest.importorskip("onnxruntime")
        return load(path, backend="onnxruntime", needs=("layer_skip",))
    if request.param.endswith("bf16"):
        skip_without_bf16()
    return load(path, backend="cpu", float_dtype="bfloat16" if request.param.endswith("bf16") else "float32")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_onednn_rows_do_not_depend_on_the_row_count(dtype):
    """oneDNN takes another path for a single row when K > 1024, and in bf16 on some CPUs for calls over 32 rows; the
    kernel sends a single row as two and splits a bf16 call where the probe saw rows change, so every M agrees."""
    if dtype == torch.bfloat16:
        skip_without_bf16()
    torch.manual_seed(0)
    weight, x = torch.randn(300, 2048) * 0.02, torch.randn(64, 2048)
    linear = float_linear(weight.to(dtype), None, "onednn")
    alone = torch.cat([linear(x[i : i + 1].to(dtype)) for i in range(64)])
    for rows in (2, 5, 9, 33, 48, 64):
        assert torch.equal(linear(x[:rows].to(dtype)), alone[:rows]), rows


def test_a_batched_verify_equals_each_sequence_verified_alone(engine):
    lm = engine.lm
    assert isinstance(lm, BatchVerifyingLM)
    prompts = [engine.encode(p) for p in PROMPTS]
    blocks = [list(range(7 + i, 8 + i + i % 6)) for i in range(len(PROMPTS))]  # 1 to 6 rows each
    alone = []
    for ids, block in zip(prompts, blocks):
        sequence = lm.new_sequence()
        sequence.prefill(ids)
        alone.append(sequence.verify(block))
    sequences = [lm.new_sequence() for _ in prompts]
    for sequence, ids in zip(sequences, prompts):
        sequence.prefill(ids)
    together = lm.verify_batch(sequences, blocks)
    assert all(torch.equal(a, b) for a, b in zip(alone, together))
    assert [s.length for s in sequences] == [len(ids) + len(block) for ids, block in zip(prompts, blocks)]


def serve(engine: Engine, requests: list[Request], metrics: Metrics | None = None, prefill_tokens: int = 256) -> list:
    """Each request's last event (Done or Failed), all submitted at once to one scheduler."""
    scheduler = Scheduler(engine, metrics or Metrics(), max_sequences=len(requests), prefill_tokens=prefill_tokens)
    inboxes = [queue.Queue() for _ in requests]
    tickets = [Ticket(r, inbox.put) for r, inbox in zip(requests, inboxes)]
    for ticket in tickets:  # all waiting before the worker starts: every one is admitted into the first round
        scheduler.submit(ticket)
    scheduler.start()
    try:
        finals = []
        for inbox in inboxes:
            event = inbox.get(timeout=120)
            while not isinstance(event, Done | Failed):
                event = inbox.get(timeout=120)
            finals.append(event)
        return finals
    finally:
        scheduler.stop()


def request(prompt: str, max_tokens: int = 24, **options) -> Request:
    return Request(prompt, chat=False, stream=True, max_tokens=max_tokens, options=options)


@pytest.mark.parametrize(
    "options",
    [{"draft": "ngram"}, {"draft": "suffix"}, {"draft": "suffix", "adaptive_k": True}, {"draft": "layerskip"}, {"draft": "none"}],
    ids=["ngram", "suffix", "suffix-adaptive-k", "layerskip", "none"],
)
def test_eight_greedy_requests_served_together_equal_each_alone(engine, options, monkeypatch):
    alone = [engine.generate(p, max_new_tokens=24, **options).tokens for p in PROMPTS]
    forwards = count_forwards(engine, monkeypatch)
    finals = serve(engine, [request(p, **options) for p in PROMPTS])
    assert [f.result.tokens for f in finals] == alone
    assert forwards[0] == [True] * len(PROMPTS)  # the eight prompts prefilled in one forward
    assert max(len(f) for f in forwards[1:]) == len(PROMPTS)  # the steps really ran all eight in one forward


def patch_forward(engine: Engine, monkeypatch, wrap) -> None:
    """Every forward of ``engine``'s model from now on goes through ``wrap(forward, blocks, skip_layers, last_only)``:
    the torch decoder's ``forward_blocks``, or the ONNX Runtime layer graphs' ``_forward`` (every sequence's)."""
    if engine.backend == "onnxruntime":
        from quasar_deploy.backends.onnx_layered import LayeredOnnxLM

        forward = LayeredOnnxLM._forward

        def layered(self, sequences, blocks, last_only=(), skip_layers=frozenset()):
            return wrap(lambda *a: forward(self, sequences, blocks, last_only, skip_layers), blocks, skip_layers, last_only)

        monkeypatch.setattr(LayeredOnnxLM, "_forward", layered)
        return
    forward_blocks = engine.lm.decoder.forward_blocks

    def torch_forward(blocks, caches, skip_layers=frozenset(), last_only=()):
        return wrap(lambda *a: forward_blocks(blocks, caches, skip_layers, last_only), blocks, skip_layers, last_only)

    monkeypatch.setattr(engine.lm.decoder, "forward_blocks", torch_forward)


def count_forwards(engine: Engine, monkeypatch) -> list[list[bool]]:
    """Records each batched forward of ``engine``'s model from now on: which of its blocks are prefills."""
    forwards = []

    def counting(forward, blocks, skip_layers, last_only):
        if not skip_layers:  # layerskip's drafts are not the scheduler's forwards
            forwards.append(list(last_only) or [False] * len(blocks))
        return forward()

    patch_forward(engine, monkeypatch, counting)
    return forwards


def prefill_lengths(engine: Engine, monkeypatch) -> list[list[int]]:
    """Records each batched forward of ``engine``'s model from now on that prefills: its prompts' lengths, in order."""
    prefills = []

    def recording(forward, blocks, skip_layers, last_only):
        if any(last_only):
            prefills.append([len(block) for block, last in zip(blocks, last_only) if last])
        return forward()

    patch_forward(engine, monkeypatch, recording)
    return prefills


def test_a_burst_of_requests_prefills_over_rounds_within_the_token_budget(engine, monkeypatch):
    alone = [engine.generate(p, max_new_tokens=16).tokens for p in PROMPTS]
    lengths = [len(engine.encode(p)) for p in PROMPTS]
    budget = max(lengths) + 1
    forwards = count_forwards(engine, monkeypatch)
    prefilled = prefill_lengths(engine, monkeypatch)
    finals = serve(engine, [request(p, 16) for p in PROMPTS], prefill_tokens=budget)
    assert [f.result.tokens for f in finals] == alone
    assert len(prefilled) > 1 and all(sum(rows) <= budget for rows in prefilled)
    assert not all(forwards[1])  # the first sequences verified while later ones prefilled


def test_a_burst_prefills_the_shortest_prompts_first(engine, monkeypatch):
    """Admitted together, prompts prefill by length, one a round at a budget of one token, ties in admission order."""
    lengths = [len(engine.encode(p)) for p in PROMPTS]
    prefilled = prefill_lengths(engine, monkeypatch)
    finals = serve(engine, [request(p, 4) for p in PROMPTS], prefill_tokens=1)
    assert all(isinstance(f, Done) for f in finals)
    assert prefilled == [[n] for n in sorted(lengths)] and lengths != sorted(lengths)


def test_a_long_prompt_is_passed_over_for_shorter_ones_at_most_pass_limit_rounds(engine, monkeypatch):
    monkeypatch.setattr(scheduler, "PASS_LIMIT", 2)
    prompts = [PROMPTS[0] * 2, *PROMPTS[1:6]]  # the first the longest: every other one is shorter
    lengths = [len(engine.encode(p)) for p in prompts]
    alone = [engine.generate(p, max_new_tokens=4).tokens for p in prompts]
    prefilled = prefill_lengths(engine, monkeypatch)
    finals = serve(engine, [request(p, 4) for p in prompts], prefill_tokens=1)
    assert [f.result.tokens for f in finals] == alone
    shorter = sorted(lengths[1:])
    assert prefilled == [[n] for n in [*shorter[:2], lengths[0], *shorter[2:]]]


def test_a_long_prompt_prefills_a_piece_a_round_while_the_others_step(engine, monkeypatch):
    """On a backend that prefills prompts in pieces (``prefill_chunk``), a long prompt takes a piece per round, within
    the round's prompt-token budget, the running sequences verifying beside it; outputs stay each request's own."""
    if getattr(engine.lm, "prefill_chunk", None) is None:
        pytest.skip("this backend prefills a prompt whole (the cpu backend without the C attention kernel)")
    # where the chunk lives: the layer graphs' shared model, the cpu backend's attention kernel
    monkeypatch.setattr(getattr(engine.lm, "model", None) or engine.lm.decoder.attention_kernel, "prefill_chunk", 8)
    prompts = [PROMPTS[0] * 3, *PROMPTS[1:4]]  # the first: ~60 tokens, 8 pieces
    alone = [engine.generate(p, max_new_tokens=16).tokens for p in prompts]
    forwards = count_forwards(engine, monkeypatch)
    finals = serve(engine, [request(p, 16) for p in prompts], prefill_tokens=16)
    assert [f.result.tokens for f in finals] == alone
    with_pieces = [f for f in forwards if any(f)]
    assert len(with_pieces) >= len(engine.encode(prompts[0])) // 8  # one piece of the long prompt a round, at most
    assert any(any(f) and not all(f) for f in forwards)  # pieces ran beside other sequences' verify blocks


def test_the_verify_step_histogram_observes_each_batched_forward_once(engine, monkeypatch):
    forwards = count_forwards(engine, monkeypatch)
    metrics = Metrics()
    finals = serve(engine, [request(p, 12) for p in PROMPTS[:4]], metrics)
    verifying = [f for f in forwards if not all(f)]
    steps = sum(f.result.stats.verify_steps for f in finals)
    observed = next(s.value for s in metrics.verify_step.collect()[0].samples if s.name.endswith("_count"))
    assert observed == len(verifying) < steps


def test_seeded_sampled_requests_served_together_equal_each_alone(engine):
    options = dict(temperature=0.8, top_p=0.9, draft="ngram")
    alone = [engine.generate(p, max_new_tokens=24, seed=i, **options).tokens for i, p in enumerate(PROMPTS)]
    finals = serve(engine, [request(p, seed=i, **options) for i, p in enumerate(PROMPTS)])
    assert [f.result.tokens for f in finals] == alone


def test_a_backend_that_cannot_batch_is_served_round_robin_with_the_same_outputs(engine):
    wrapped = slow_engine(engine, delay=0)
    assert not isinstance(wrapped.lm, BatchVerifyingLM)
    alone = [engine.generate(p, max_new_tokens=16).tokens for p in PROMPTS[:4]]
    assert [f.result.tokens for f in serve(wrapped, [request(p, 16) for p in PROMPTS[:4]])] == alone


def test_a_failing_batched_forward_fails_its_requests_and_not_the_scheduler(engine, monkeypatch):
    def broken(forward, blocks, skip_layers, last_only):
        if len(blocks) > 1:
            raise RuntimeError("out of memory")
        return forward()

    patch_forward(engine, monkeypatch, broken)
    finals = serve(engine, [request(p, 8) for p in PROMPTS[:3]])
    assert all(isinstance(f, Failed) and f.error.status == 500 and "out of memory" in f.error.message for f in finals)


def test_requests_arriving_while_the_first_opens_join_its_round(engine, monkeypatch):
    """The request that wakes the worker opens (tokenizing: slow here) while the rest of its burst arrives; they are
    admitted before the round runs, so the shortest prompt of the whole burst prefills first, not the first to come."""
    prompts = [PROMPTS[0] * 2, *PROMPTS[1:4]]  # the first the longest
    lengths = [len(engine.encode(p)) for p in prompts]
    encode, opening = engine.encode, threading.Event()

    def slow_encode(text):
        if text == prompts[0]:
            opening.set()
            time.sleep(0.5)
        return encode(text)

    monkeypatch.setattr(engine, "encode", slow_encode)
    prefilled = prefill_lengths(engine, monkeypatch)
    scheduler = Scheduler(engine, Metrics(), max_sequences=len(prompts), prefill_tokens=1)
    inboxes = [queue.Queue() for _ in prompts]
    tickets = [Ticket(request(p, 4), inbox.put) for p, inbox in zip(prompts, inboxes)]
    scheduler.start()
    try:
        scheduler.submit(tickets[0])
        assert opening.wait(30)
        for ticket in tickets[1:]:
            scheduler.submit(ticket)
        for inbox in inboxes:
            while not isinstance(event := inbox.get(timeout=120), Done | Failed):
                pass
            assert isinstance(event, Done)
    finally:
        scheduler.stop()
    assert prefilled[0] == [min(lengths)] and lengths[0] == max(lengths)
