"""ONNX Runtime's batched layer graphs (``backends/onnx_layered``): rows of many sequences per step, each as alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("onnxruntime")

from quasar_deploy.api import load  # noqa: E402
from quasar_deploy.artifact import open_model_files  # noqa: E402
from quasar_deploy.backends.onnx_layered import ROTARY_CHUNK, LayeredOnnxLM, RotaryTable  # noqa: E402
from quasar_deploy.backends.onnxruntime import load_onnx, load_onnx_export  # noqa: E402
from quasar_deploy.backends.torch_backend import load_cpu  # noqa: E402
from quasar_deploy.cpu import decoder_ops  # noqa: E402
from quasar_deploy.errors import QuasarError  # noqa: E402
from quasar_deploy.model import rotary  # noqa: E402
from quasar_deploy.speculative.causal_lm import BatchVerifyingLM, LayerSkippingLM  # noqa: E402

PROMPT = [3, 17, 52, 9, 300, 41, 41, 7]
NEEDS = ("layer_skip",)


@pytest.fixture(scope="module", params=["kernel", "GroupQueryAttention"])
def layered(request, tiny_artifact) -> LayeredOnnxLM:
    """The layer graphs with each attention they may run: the C kernel (where this machine builds and runs it) and ORT's
    GroupQueryAttention (where it does not)."""
    if request.param == "kernel" and decoder_ops.load() is None:
        pytest.skip(f"the C attention kernel does not run here: {decoder_ops.why_not()}")
    with pytest.MonkeyPatch.context() as patch:
        if request.param != "kernel":
            patch.setattr(decoder_ops, "load", lambda dim=None: None)
        lm = load_onnx(tiny_artifact, threads=2, needs=NEEDS)
    assert (lm.model.kernel is not None) == (request.param == "kernel")
    return lm


@pytest.fixture(scope="module")
def reference(tiny_artifact):
    """The torch decoder with the exact reference int8 kernel."""
    return load_cpu(tiny_artifact, int8_kernel="reference")


def close(got: torch.Tensor, expected: torch.Tensor) -> bool:
    """The bound the whole-graph export is held to against the reference (tests/test_onnx_backend.py): the int8 products
    are exact on both sides, the float parts agree up to float32 rounding."""
    return (got - expected).abs().max().item() < 1e-4 and torch.equal(got.argmax(-1), expected.argmax(-1))


def test_it_batches_and_skips_layers(layered):
    assert isinstance(layered, BatchVerifyingLM) and isinstance(layered, LayerSkippingLM)
    assert "layer graphs" in layered.description


def test_a_batched_step_equals_each_sequence_alone(layered):
    prompts = [PROMPT[: 3 + i] * (1 + i % 3) for i in range(6)]
    blocks = [list(range(7 + i, 8 + i + i % 6)) for i in range(6)]  # 1 to 6 rows each
    alone_first, alone = [], []
    for ids, block in zip(prompts, blocks):
        sequence = layered.new_sequence()
        alone_first.append(sequence.prefill(ids))
        alone.append(sequence.verify(block))
    sequences = [layered.new_sequence() for _ in prompts]
    first = layered.verify_batch(sequences, prompts, [True] * len(prompts))
    assert all(torch.equal(a, b) for a, b in zip(alone_first, first))
    together = layered.verify_batch(sequences, blocks)
    assert all(torch.equal(a, b) for a, b in zip(alone, together))
    assert [s.length for s in sequences] == [len(p) + len(b) for p, b in zip(prompts, blocks)]
    # a prompt arriving while others verify: one forward, each part as alone
    late = layered.new_sequence()
    for sequence, block in zip(sequences, blocks):
        sequence.truncate(sequence.length - len(block))
    mixed = layered.verify_batch([late, *sequences[:3]], [prompts[5], *blocks[:3]], [True, False, False, False])
    assert torch.equal(mixed[0], alone_first[5]) and all(torch.equal(a, b) for a, b in zip(alone[:3], mixed[1:]))


def test_a_prompt_prefills_in_pieces_alone_and_among_others_alike(layered, monkeypatch):
    """A prompt runs in pieces of ``prefill_chunk`` tokens, alone (``prefill``) as in a server's rounds (a piece per
    ``verify_batch``, beside other sequences' blocks): the same bits, and so the same cache."""
    monkeypatch.setattr(layered.model, "prefill_chunk", 16)
    prompt = [(5 * i) % 4000 + 3 for i in range(45)]  # pieces of 16, 16 and 13 tokens
    alone = layered.new_sequence()
    expected = alone.prefill(prompt)
    pieced, other = layered.new_sequence(), layered.new_sequence()
    other.prefill(PROMPT)
    for start in range(0, len(prompt), 16):
        logits = layered.verify_batch([pieced, other], [prompt[start : start + 16], [4, 5]], [True, False])
        other.truncate(len(PROMPT))
    assert torch.equal(logits[0], expected) and pieced.length == len(prompt)
    assert torch.equal(pieced.verify([7, 8]), alone.verify([7, 8]))
    for bad in (prompt[:17], prompt[:3]):  # longer than a piece; then not at a piece's start
        with pytest.raises(ValueError, match="a piece of its prompt"):
            layered.verify_batch([pieced], [bad], [True])


def test_an_int8_head_runs_as_a_graph_of_its_own_and_batches(tiny_int8_head_artifact):
    lm = load_onnx(tiny_int8_head_artifact, threads=1, needs=NEEDS)
    assert "int8 lm_head graph" in lm.description
    reference = load_cpu(tiny_int8_head_artifact, int8_kernel="reference")
    assert close(lm.prefill(PROMPT), reference.prefill(PROMPT))
    # the head quantizes its input too: where the float parts before it differ by rounding, one int8 code can round
    # the other way (docs/architecture.md, "Numerics across backends"), which moves its row's logits by ~1e-3 here
    got, expected = lm.verify([4, 5, 6]), reference.verify([4, 5, 6])
    assert (got - expected).abs().max().item() < 1e-2 and torch.equal(got.argmax(-1), expected.argmax(-1))
    lm.truncate(len(PROMPT))
    other = lm.new_sequence()
    other.prefill(PROMPT[:5])
    alone = [lm.verify([4, 5, 6]), other.verify([9])]
    lm.truncate(len(PROMPT))
    other.truncate(5)
    assert all(torch.equal(a, b) for a, b in zip(alone, lm.verify_batch([lm, other], [[4, 5, 6], [9]])))


def test_a_rows_logits_do_not_depend_on_its_blocks_size(layered):
    """A one-token decode and the same row in a verify block agree (the kernel by construction; GroupQueryAttention gets
    one row sent as two: ``_attend``), so speculative greedy output is the verifier's own greedy decode."""
    block = [4, 17, 300, 9, 2, 41, 7, 8]
    lm = layered.new_sequence()
    lm.prefill(PROMPT)
    full = lm.verify(block)
    for n in range(1, len(block)):
        lm.truncate(len(PROMPT))
        assert torch.equal(lm.verify(block[:n]), full[:n]), n


def test_logits_agree_with_the_torch_decoder_through_a_rollback(layered, reference):
    draft = [17, 300, 300, 9, 2]
    lm = layered.new_sequence()
    assert close(lm.prefill(PROMPT), reference.prefill(PROMPT))
    for backend in (lm, reference):
        backend.verify([4, 4, 4, 4])  # a rejected draft...
        backend.truncate(len(PROMPT) + 1)  # ...keeping its first token
    assert close(lm.verify(draft), reference.verify(draft))
    assert lm.length == reference.length == len(PROMPT) + 1 + len(draft)
    with pytest.raises(ValueError):
        lm.truncate(lm.length + 1)


def test_rolled_back_cache_rows_are_the_same_bits_as_never_written_ones(layered):
    """A rollback only moves the length; the rows kept were computed row by row, so they equal a cache that never held
    the rejected tokens."""
    draft = [17, 300, 300, 9, 2]
    rolled, straight = layered.new_sequence(), layered.new_sequence()
    for sequence in (rolled, straight):
        sequence.prefill(PROMPT)
    rolled.verify([4, 8, 8, 8])
    rolled.truncate(len(PROMPT) + 1)
    straight.verify([4])
    assert torch.equal(rolled.verify(draft), straight.verify(draft))


def test_the_cache_grows_past_its_first_buffers_keeping_every_row(layered):
    """Buffers that grow (copied into twice the room) give the bits of buffers that had the room from the start."""
    prompt = [(7 * i) % 4000 + 5 for i in range(250)]
    grown, roomy = layered.new_sequence(), layered.new_sequence()
    roomy._reserve(300)
    for sequence in (grown, roomy):
        sequence.prefill(prompt)
    assert grown._capacity < 256 + 6 <= roomy._capacity
    for block in ([5, 6, 7, 8, 9, 10], [11] * 6, [12, 13]):  # across 256 positions: the grown one's first capacity
        assert torch.equal(grown.verify(block), roomy.verify(block))
    assert grown._capacity == roomy._capacity
    held = sum(v.nbytes if isinstance(v, np.ndarray) else v.numpy().nbytes for pair in grown._cache for v in pair)
    assert held <= grown.kv_cache_bytes(grown.length)


def test_skipped_layers_match_the_torch_decoder_skipping_them(layered, reference):
    lm = layered.new_sequence()
    lm.prefill(PROMPT)
    reference.prefill(PROMPT)
    skip = frozenset({1})
    got = lm.verify_skipping([4, 5, 6], skip)
    assert close(got, reference.verify_skipping([4, 5, 6], skip))
    lm.truncate(len(PROMPT))
    assert not torch.equal(got, lm.verify([4, 5, 6]))


def test_engines_on_the_layer_graphs_decode_as_the_cpu_backend(tiny_artifact):
    prompt = "the cat sat on the mat. the cat sat on the"
    engine = load(tiny_artifact.path, backend="onnxruntime", needs=NEEDS, threads=1)
    expected = load(tiny_artifact.path, backend="cpu", int8_kernel="reference").generate(prompt, max_new_tokens=16, draft="ngram")
    for draft in ("none", "ngram", "layerskip"):  # "none": one-token decode steps, the verifier's own greedy decode
        assert engine.generate(prompt, max_new_tokens=16, draft=draft).tokens == expected.tokens


def test_what_cannot_run_as_layer_graphs_is_refused_in_one_line(tiny_onnx, tiny_qwen3, tiny_artifact):
    with pytest.raises(QuasarError, match="an export runs as one whole graph"):
        load_onnx_export(tiny_onnx, needs=NEEDS)
    with pytest.raises(QuasarError, match="a float checkpoint"):
        load_onnx(open_model_files(tiny_qwen3), needs=NEEDS)
    with pytest.raises(QuasarError, match="run on its cpu provider, not cuda"):
        load_onnx(tiny_artifact, provider="cuda", needs=NEEDS)


def test_a_position_gets_the_same_rotary_bits_in_any_company():
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
    table = RotaryTable(inv_freq)
    positions = np.array([5, ROTARY_CHUNK + 3, 2 * ROTARY_CHUNK - 1, 7])
    cos, sin = table.rows(positions)
    for i, position in enumerate(positions):
        alone_cos, alone_sin = table.rows(np.array([position]))
        assert np.array_equal(alone_cos[0], cos[i]) and np.array_equal(alone_sin[0], sin[i])
    chunk_cos, _ = rotary(inv_freq, ROTARY_CHUNK, ROTARY_CHUNK, torch.float32)
    assert np.array_equal(cos[1], chunk_cos[3].numpy())
