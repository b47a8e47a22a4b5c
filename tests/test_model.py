"""Our decoder must compute exactly what transformers computes, cache or no cache."""

import pytest
import torch

from quasar_deploy.artifact import open_model_files
from quasar_deploy.backends import create_backend

from .tiny import save_tiny


@pytest.mark.parametrize(
    "arch,overrides",
    [
        ("qwen3", {}),
        (
            "llama",
            {
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 32,
                }
            },
        ),
        ("qwen2", {"num_key_value_heads": 4}),
        ("mistral", {"sliding_window": 8}),
        ("qwen3", {"tie_word_embeddings": True}),
    ],
)
def test_logits_match_transformers(tmp_path, arch, overrides):
    import transformers

    path = save_tiny(tmp_path / arch, arch, **overrides)
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.randint(0, 4096, (24,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = reference(ids[None]).logits[0]
    decoder = open_model_files(path).decoder()
    cache = decoder.new_cache(capacity=4)
    pieces = [decoder(ids[:9], cache), decoder(ids[9:10], cache), decoder(ids[10:], cache)]
    torch.testing.assert_close(torch.cat(pieces), expected, atol=2e-5, rtol=1e-4)


def test_truncate_rolls_back(tiny_qwen3):
    lm = create_backend("cpu", open_model_files(tiny_qwen3))
    ids = list(range(5, 25))
    full = lm.verify(ids)
    lm.truncate(12)
    assert lm.length == 12
    again = lm.verify(ids[12:])
    torch.testing.assert_close(again, full[12:], atol=1e-5, rtol=1e-5)
    last = lm.prefill(ids[:7])
    torch.testing.assert_close(last, full[6], atol=1e-5, rtol=1e-5)
    assert lm.length == 7


@pytest.mark.parametrize("arch,overrides", [("qwen3", {}), ("mistral", {"sliding_window": 6})])
def test_verify_block_equals_single_token_decodes_bit_for_bit(tmp_path, arch, overrides):
    """What makes greedy speculation lossless on a W8A8 verifier: a k+1 block computes what k+1 decodes do."""
    from .tiny import naive_w8a8_decoder

    decoder = naive_w8a8_decoder(save_tiny(tmp_path / arch, arch, **overrides), int8_kernel="fbgemm")
    ids = torch.randint(0, 4096, (16,), generator=torch.Generator().manual_seed(5))
    cache = decoder.new_cache()
    decoder(ids[:10], cache)
    block = decoder(ids[10:], cache)
    cache.truncate(10)
    singles = torch.cat([decoder(ids[i : i + 1], cache) for i in range(10, 16)])
    # Bit-identical up to the float lm_head, whose GEMM may round differently for 6 rows than for 1;
    # row-count-dependent attention would show here as ~1e-3 (int8 rounding amplifies it), not ~1e-6.
    assert (block - singles).abs().max() < 1e-5
