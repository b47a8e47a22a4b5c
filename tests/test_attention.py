"""Attention after the prefill: a row computes the same bits alone (a one-token decode), in a verify block and beside
other sequences of any cache length, with torch's ops and with the C kernel the cpu backend attends with where it runs.
Greedy speculation is lossless and serving batch-invariant because of it."""

from __future__ import annotations

import pytest
import torch

from quasar_deploy.artifact import open_model_files
from quasar_deploy.backends.torch_backend import BatchingTorchCausalLM, cpu_causal_lm
from quasar_deploy.cpu.linears import onednn_available
from quasar_deploy.model import KEY_CHUNK, QUERY_ROWS
from quasar_deploy.scheme import quantize_weight

from .tiny import save_tiny

pytestmark = pytest.mark.skipif(not onednn_available(), reason="bit-identical rows need the row-invariant oneDNN float kernel")

IDS = torch.randint(0, 4096, (KEY_CHUNK + 64,), generator=torch.Generator().manual_seed(3)).tolist()


@pytest.fixture(
    scope="module",
    params=[("qwen3", {}, "auto"), ("qwen3", {}, "torch"), ("mistral", {"sliding_window": 40}, "auto")],
    ids=["qwen3", "qwen3-torch-attention", "sliding-window"],
)
def lm(request, tmp_path_factory) -> BatchingTorchCausalLM:
    """A W8A8 verifier (naive weight quantization) on the cpu backend's row-invariant kernels: its attention the C
    kernel where this CPU runs it ("auto"; a sliding window keeps torch's ops), or torch's ops."""
    arch, overrides, attention = request.param
    decoder = open_model_files(save_tiny(tmp_path_factory.mktemp(arch), arch, **overrides)).decoder()
    for _, linear in decoder.linears():
        linear.set_quantized(*quantize_weight(linear.weight.data), None)
    lm = cpu_causal_lm(decoder, attention=attention)
    assert isinstance(lm, BatchingTorchCausalLM)
    return lm


def one_token_decodes(lm, prompt: int, rows: int) -> torch.Tensor:
    sequence = lm.new_sequence()
    sequence.prefill(IDS[:prompt])
    return torch.cat([sequence.verify(IDS[i : i + 1]) for i in range(prompt, prompt + rows)])


# prompts ending well inside a key chunk, just before its end (the block crosses into the next chunk), and past it
@pytest.mark.parametrize("prompt", [5, KEY_CHUNK - 3, KEY_CHUNK + 10])
@pytest.mark.parametrize("rows", [2, 6, QUERY_ROWS + 4])
def test_a_verify_block_computes_what_one_token_decodes_compute(lm, prompt, rows):
    sequence = lm.new_sequence()
    sequence.prefill(IDS[:prompt])
    assert torch.equal(sequence.verify(IDS[prompt : prompt + rows]), one_token_decodes(lm, prompt, rows))


def test_blocks_of_sequences_with_different_cache_lengths_compute_what_each_computes_alone(lm):
    prompts, rows = [3, KEY_CHUNK - 2, 120, 17, KEY_CHUNK + 30], [6, 8, 1, QUERY_ROWS + 3, 4]
    sequences = [lm.new_sequence() for _ in prompts]
    for sequence, prompt in zip(sequences, prompts):
        sequence.prefill(IDS[:prompt])
    together = lm.verify_batch(sequences, [IDS[p : p + r] for p, r in zip(prompts, rows)])
    for logits, prompt, n in zip(together, prompts, rows):
        assert torch.equal(logits, one_token_decodes(lm, prompt, n)), (prompt, n)


def test_a_row_cannot_see_the_rows_after_it_in_its_block(lm):
    """Changing a block's later tokens leaves its earlier rows' logits unchanged, bit for bit."""
    sequence = lm.new_sequence()
    sequence.prefill(IDS[:40])
    first = sequence.verify(IDS[40:46])
    sequence.truncate(40)
    second = sequence.verify(IDS[40:43] + [7, 8, 9])
    assert torch.equal(first[:3], second[:3]) and not torch.equal(first[3:], second[3:])


def test_prefills_in_a_batch_compute_what_each_computes_alone(lm):
    prompts = [30, 7, KEY_CHUNK + 20]
    alone = []
    for prompt in prompts:
        sequence = lm.new_sequence()
        alone.append(sequence.prefill(IDS[:prompt]))
    running = lm.new_sequence()
    running.prefill(IDS[:50])
    sequences = [lm.new_sequence() for _ in prompts] + [running]
    chunk = lm.prefill_chunk or max(prompts)  # the C kernel's backend takes a long prompt a piece per forward
    blocks = [IDS[: min(p, chunk)] for p in prompts] + [IDS[50:56]]
    together = lm.verify_batch(sequences, blocks, [True] * len(prompts) + [False])
    assert torch.equal(together[-1], one_token_decodes(lm, 50, 6))
    for i, prompt in enumerate(prompts):
        for start in range(chunk, prompt, chunk):  # the rest of a longer prompt, a piece per forward
            together[i] = lm.verify_batch([sequences[i]], [IDS[start : min(prompt, start + chunk)]], [True])[0]
    assert all(torch.equal(a, b) for a, b in zip(alone, together))
    assert [s.length for s in sequences] == [*prompts, 56]
