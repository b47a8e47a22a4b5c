"""The cpu backend's attention: ``cpu_attention``'s C kernel inside the torch decoder where this CPU runs it, torch's
ops elsewhere. Its choice, its caches' life (growth, truncation) and its values against torch's attention. Bit-level
independence of a row from its block and company is ``test_attention``'s, for both attentions."""

from __future__ import annotations

import pytest
import torch

from quasar_deploy.artifact import open_model_files
from quasar_deploy.backends.torch_backend import bind_cpu_attention, cpu_causal_lm, load_cpu
from quasar_deploy.cpu import decoder_ops
from quasar_deploy.errors import QuasarError
from quasar_deploy.model import KEY_CHUNK

from .helpers import skip_without_bf16
from .tiny import save_tiny, save_tiny_qwen2_with_biases

IDS = torch.randint(0, 4096, (2 * KEY_CHUNK + 40,), generator=torch.Generator().manual_seed(5)).tolist()


def kernel_runs(dim: int = 16) -> bool:
    return decoder_ops.load(dim) is not None


needs_kernel = pytest.mark.skipif(not kernel_runs(), reason="no build of the C attention kernel runs on this CPU (doctor says why)")


@needs_kernel
def test_the_cpu_backend_attends_with_the_kernel_where_it_runs(tiny_qwen3):
    lm = load_cpu(open_model_files(tiny_qwen3))
    assert isinstance(lm.decoder.attention_kernel, decoder_ops.TorchAttention)
    assert "attention quasar C kernel" in lm.description
    assert isinstance(lm.cache, decoder_ops.TiledKVCache)


def test_without_a_kernel_or_with_a_sliding_window_it_attends_with_torch_ops(tiny_qwen3, tmp_path, monkeypatch):
    assert load_cpu(open_model_files(tiny_qwen3), attention="torch").decoder.attention_kernel is None
    windowed = load_cpu(open_model_files(save_tiny(tmp_path / "mistral", "mistral", sliding_window=40)))
    assert windowed.decoder.attention_kernel is None and "attention torch ops" in windowed.description
    monkeypatch.setattr(decoder_ops, "load", lambda dim=None: None)  # a CPU no build runs on, or no compiler
    lm = load_cpu(open_model_files(tiny_qwen3))
    assert lm.decoder.attention_kernel is None and "attention torch ops" in lm.description


def test_an_unknown_attention_is_refused_in_one_line(tiny_qwen3):
    with pytest.raises(QuasarError, match="attention is one of auto, torch"):
        load_cpu(open_model_files(tiny_qwen3), attention="flash")


@needs_kernel
@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen2-biases"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_its_logits_are_torch_attentions_within_float_rounding(tiny_qwen3, tmp_path, family, dtype):
    """Prefill, a verify block and one-token decodes past a key chunk: the same logits as torch's attention (and torch's
    norms, rotary and SiLU gates) up to the rounding of float sums taken in another order (bf16: the float32 kernel's
    outputs rounded to bf16 once more). Qwen3 norms q and k in the kernel, Llama does not, Qwen2 adds q/k/v biases."""
    if dtype == torch.bfloat16:
        skip_without_bf16()
    model = {
        "qwen3": lambda: tiny_qwen3,
        "llama": lambda: save_tiny(tmp_path / "llama", "llama"),
        "qwen2-biases": lambda: save_tiny_qwen2_with_biases(tmp_path / "qwen2"),
    }
    files = open_model_files(model[family]())
    kernel, ops = (cpu_causal_lm(files.decoder(dtype), attention=a) for a in ("auto", "torch"))
    assert kernel.decoder.attention_kernel is not None and ops.decoder.attention_kernel is None
    prompt = KEY_CHUNK - 4
    got = [kernel.prefill(IDS[:prompt])[None], kernel.verify(IDS[prompt : prompt + 6])]
    want = [ops.prefill(IDS[:prompt])[None], ops.verify(IDS[prompt : prompt + 6])]
    for i in range(prompt + 6, prompt + 12):
        got.append(kernel.verify(IDS[i : i + 1]))
        want.append(ops.verify(IDS[i : i + 1]))
    got, want = torch.cat(got), torch.cat(want)
    tolerance = 1e-4 if dtype == torch.float32 else 0.1  # of logits ~1 in size: float32 sums, or bf16's 8-bit mantissa
    assert (got - want).abs().max().item() < tolerance * want.abs().max().item()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9


@needs_kernel
def test_a_cache_grown_mid_sequence_keeps_what_it_held(tiny_qwen3):
    """A sequence whose cache grows while it decodes computes what one with room from the start computes."""
    lm = load_cpu(open_model_files(tiny_qwen3))
    roomy = lm.new_sequence()
    roomy.cache = lm.decoder.new_cache(4 * KEY_CHUNK)
    growing = lm.new_sequence()
    assert growing.cache.capacity == KEY_CHUNK
    for sequence in (roomy, growing):
        sequence.prefill(IDS[: KEY_CHUNK - 2])
    for start in range(KEY_CHUNK - 2, 2 * KEY_CHUNK - 20, 5):  # 6 rows verified, 5 kept: a rejected draft each time
        block = IDS[start : start + 6]
        assert torch.equal(growing.verify(block), roomy.verify(block))
        growing.truncate(start + 5)
        roomy.truncate(start + 5)
    assert growing.cache.capacity == 2 * KEY_CHUNK


@needs_kernel
def test_its_cache_is_counted_in_float32(tiny_qwen3):
    """The kernel caches float32 keys and values even for a bf16 decoder: memory budgets count four bytes each."""
    skip_without_bf16()
    files = open_model_files(tiny_qwen3)
    kernel = cpu_causal_lm(files.decoder(torch.bfloat16))
    ops = cpu_causal_lm(files.decoder(torch.bfloat16), attention="torch")
    assert kernel.kv_cache_bytes(1000) == 2 * ops.kv_cache_bytes(1000)


@needs_kernel
def test_binding_decides_the_caches_a_decoder_makes(tiny_qwen3):
    """The kernel reads caches of its own layout: a decoder bound to it makes those, unbound torch's again."""
    decoder = open_model_files(tiny_qwen3).decoder()
    decoder.prepare("torch", "reference", fuse=True)
    bind_cpu_attention(decoder)
    assert isinstance(decoder.new_cache(), decoder_ops.TiledKVCache)
    bind_cpu_attention(decoder, "torch")
    assert not isinstance(decoder.new_cache(), decoder_ops.TiledKVCache)


@needs_kernel
def test_a_prompt_prefilled_in_pieces_gives_the_bits_of_one_forward(tiny_qwen3, monkeypatch):
    """With the kernel a prompt prefills a piece per forward (a server spreads a long one over rounds); every row is the
    same bits in any block, so the pieces end where one forward over the prompt ends."""
    lm = load_cpu(open_model_files(tiny_qwen3))
    assert lm.prefill_chunk == 256
    prompt = IDS[:100]
    monkeypatch.setattr(lm.decoder.attention_kernel, "prefill_chunk", None)
    assert lm.prefill_chunk is None
    whole = lm.prefill(prompt)
    after_whole = lm.verify(IDS[100:106])
    for chunk in (16, 33, 1):
        monkeypatch.setattr(lm.decoder.attention_kernel, "prefill_chunk", chunk)
        assert torch.equal(lm.prefill(prompt), whole), chunk
        assert torch.equal(lm.verify(IDS[100:106]), after_whole), chunk
    sequence = lm.new_sequence()
    sequence.prefill(prompt[:5])
    with pytest.raises(ValueError, match="a prefill block is a piece of its prompt: at most 1 tokens"):
        lm.verify_batch([sequence], [prompt[5:7]], [True])
