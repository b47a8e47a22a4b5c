"""q/k/v and gate/up fused into one kernel call each: the same results as separate calls, one call's overhead."""

import pytest
import torch

from quasar_deploy.artifact import open_model_files
from quasar_deploy.cpu.choice import default_int8_kernel
from quasar_deploy.cpu.linears import default_float_kernel
from quasar_deploy.scheme import quantize_weight

from .tiny import save_tiny


def _decoders(path, quantize: bool, static: bool = False):
    decoders = []
    for _ in range(2):
        decoder = open_model_files(path).decoder()
        if quantize:
            for _, linear in decoder.linears():
                wq, scale = quantize_weight(linear.weight.data)
                linear.set_quantized(wq, scale, torch.tensor([0.05]) if static else None)
        decoders.append(decoder)
    return decoders


@pytest.mark.parametrize("static", [False, True])
def test_fused_w8a8_equals_separate_bit_for_bit(tmp_path, static):
    path = save_tiny(tmp_path / "qwen2", "qwen2")  # q/k/v biases: fused with their weights
    separate, fused = _decoders(path, quantize=True, static=static)
    separate.prepare(default_float_kernel(), default_int8_kernel())
    fused.prepare(default_float_kernel(), default_int8_kernel(), fuse=True)
    assert fused.model.layers[0].self_attn.qkv is not None and fused.model.layers[0].mlp.gate_up is not None
    assert fused.model.layers[0].self_attn.q_proj.weight.is_meta  # the fused kernel holds the only copy
    ids = torch.arange(3, 40)
    a_cache, b_cache = separate.new_cache(), fused.new_cache()
    assert torch.equal(separate(ids, a_cache), fused(ids, b_cache))
    assert torch.equal(separate(ids[:4], a_cache), fused(ids[:4], b_cache))  # a verify block on the warm cache


def test_fused_float_matches_separate(tiny_qwen3):
    separate, fused = _decoders(tiny_qwen3, quantize=False)
    separate.prepare(default_float_kernel(), default_int8_kernel())
    fused.prepare(default_float_kernel(), default_int8_kernel(), fuse=True)
    ids = torch.arange(3, 40)
    torch.testing.assert_close(separate(ids, separate.new_cache()), fused(ids, fused.new_cache()), atol=1e-5, rtol=1e-5)


def test_mixed_groups_stay_separate(tiny_qwen3):
    decoder = open_model_files(tiny_qwen3).decoder()
    attention = decoder.model.layers[0].self_attn
    wq, scale = quantize_weight(attention.q_proj.weight.data)
    attention.q_proj.set_quantized(wq, scale, None)  # q in int8, k and v float: no shared activation quantization
    decoder.prepare("torch", "reference", fuse=True)
    assert attention.qkv is None and decoder.model.layers[1].self_attn.qkv is not None
    ids = torch.arange(3, 20)
    assert torch.isfinite(decoder(ids, decoder.new_cache())).all()
