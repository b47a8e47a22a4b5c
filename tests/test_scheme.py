"""The W8A8 numerics: the reference is exact, kernels match it, per-token quantization is batch-invariant."""

import pytest
import torch

from quasar_deploy.cpu.choice import default_int8_kernel, int8_probe
from quasar_deploy.cpu.linears import (
    fbgemm_available,
    int8_linear,
    onednn_int8_available,
    onednn_int8_bit_exact,
    quasar_int8_available,
    vnni_available,
)
from quasar_deploy.scheme import int8_matmul_int32, per_token_scale, quantize_activation, quantize_weight, reference_linear


def _layer(out_features=48, in_features=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=g)
    x = torch.randn(7, in_features, generator=g) * torch.rand(in_features, generator=g) * 5
    x[:, min(3, in_features - 1)] *= 40  # an outlier channel
    return weight, x, torch.randn(out_features, generator=g)


def test_weight_quantization_is_symmetric_per_channel():
    weight, _, _ = _layer()
    q, scale = quantize_weight(weight)
    assert q.dtype == torch.int8 and scale.shape == (48, 1) and scale.dtype == torch.float32
    assert int(q.abs().max()) == 127 and int(q.min()) >= -127
    assert torch.equal(q.abs().amax(dim=1), torch.full((48,), 127, dtype=torch.int8))
    assert (q.float() * scale - weight).abs().max() <= scale.max() / 2 + 1e-6


def test_reference_accumulates_integer_exact():
    weight, x, _ = _layer(in_features=4096)
    wq, _ = quantize_weight(weight)
    xq = quantize_activation(x, per_token_scale(x))
    exact = (xq.to(torch.int64) @ wq.to(torch.int64).t()).double()
    assert torch.equal(int8_matmul_int32(xq, wq), exact)


def test_reference_is_batch_invariant():
    weight, x, bias = _layer()
    wq, scale = quantize_weight(weight)
    batch = reference_linear(x, wq, scale, bias)
    for i in range(x.shape[0]):
        assert torch.equal(reference_linear(x[i : i + 1], wq, scale, bias)[0], batch[i])


NEEDS_VNNI = "needs AVX-512 VNNI"
EXACT_KERNELS = [
    pytest.param("fbgemm", marks=pytest.mark.skipif(not fbgemm_available(), reason="FBGEMM is x86-only")),
    pytest.param("fbgemm-vnni", marks=pytest.mark.skipif(not (fbgemm_available() and vnni_available()), reason="needs AVX-512 VNNI")),
    pytest.param("onednn-vnni", marks=pytest.mark.skipif(not (onednn_int8_available() and onednn_int8_bit_exact()), reason=NEEDS_VNNI)),
    pytest.param("quasar", marks=pytest.mark.skipif(not quasar_int8_available(), reason="our VNNI kernel does not run here")),
]
VNNI_KERNELS = EXACT_KERNELS[2:]


@pytest.mark.parametrize("kernel", EXACT_KERNELS)
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("in_features", [1, 96, 1024, 4096])
def test_int8_kernels_equal_reference(kernel, static, in_features):
    weight, x, bias = _layer(in_features=in_features)
    x[:, :4] *= 40  # outlier channels: full-range int8 codes in every row
    wq, scale = quantize_weight(weight)
    input_scale = (x.abs().max() / 127).reshape(1) if static else None
    expected = int8_linear(wq, scale, bias, input_scale, "reference")(x)
    got = int8_linear(wq, scale, bias, input_scale, kernel)(x)
    assert torch.equal(got, expected)
    one_row = int8_linear(wq, scale, bias, input_scale, kernel)(x[2:3])
    assert torch.equal(one_row[0], got[2])


@pytest.mark.parametrize("kernel", VNNI_KERNELS)
def test_32_bit_kernels_are_exact_past_float32s_integer_range(kernel):
    """Accumulators past 2^24 (full-range codes, K = 8192) round as the reference's ``.float()`` rounds them."""
    k = 8192
    weight = torch.ones(4, k)
    weight[1], weight[2, ::2], weight[3] = -1, -1, torch.linspace(-1, 1, k)
    x = torch.ones(3, k)
    x[1, ::3], x[2] = -1, torch.linspace(-1, 1, k) + 1e-3
    wq, scale = quantize_weight(weight)
    expected = int8_linear(wq, scale, None, None, "reference")(x)
    assert expected.abs().max() > 0 and torch.equal(int8_linear(wq, scale, None, None, kernel)(x), expected)


def test_the_default_int8_kernel_follows_the_cpu():
    from quasar_deploy.cpu.choice import ONNXRUNTIME, onnxruntime_int8_bit_exact

    offered = (
        ("fbgemm-vnni", vnni_available()),
        ("onednn-vnni", onednn_int8_bit_exact()),
        ("quasar", quasar_int8_available()),
        ("fbgemm", fbgemm_available() and not vnni_available()),
    )
    exact = [name for name, ok in offered if ok]
    exact += [ONNXRUNTIME] if exact and onnxruntime_int8_bit_exact() else []
    probe = int8_probe()
    assert sorted(probe.ms) == sorted(exact)  # every exact kernel timed (ONNX Runtime's beside them), and no other
    expected = probe.kernel if exact else "reference"
    assert expected != ONNXRUNTIME and default_int8_kernel("cpu") == expected and default_int8_kernel("cuda") == "reference"


@pytest.mark.skipif(not fbgemm_available(), reason="FBGEMM is x86-only")
def test_full_range_activations_overflow_without_the_split_unless_the_cpu_has_vnni():
    """Guards the reason for the split: FBGEMM's AVX2 kernel saturates with 8-bit activations.

    CPUs with AVX-512 VNNI (``vpdpbusd`` accumulates u8*s8 straight into 32 bits) run FBGEMM's VNNI
    kernel instead, which cannot overflow: there the naive call is exact, and this checks that.
    """
    weight, _, _ = _layer(in_features=1024)
    x = torch.randn(7, 1024, generator=torch.Generator().manual_seed(1))
    wq, scale = quantize_weight(weight)
    torch.backends.quantized.engine = "fbgemm"
    qweight = torch._make_per_channel_quantized_tensor(wq, scale.reshape(-1).double(), torch.zeros(48, dtype=torch.long), 0)
    packed = torch.ops.quantized.linear_prepack(qweight, None)
    xq = quantize_activation(x, per_token_scale(x))
    pin = torch.zeros(2, 1024)
    pin[0, 0], pin[1, 0] = -127.0, 128.0
    naive = torch.ops.quantized.linear_dynamic(torch.cat([xq, pin]), packed, False)[:7] / scale.reshape(1, -1)
    exact = int8_matmul_int32(xq, wq).float()
    if vnni_available():  # the probe (codes at the extremes) found FBGEMM's 32-bit kernel; flags may list one it does not run
        assert (naive - exact).abs().max() < 0.5
    else:
        assert (naive - exact).abs().max() > 100
