"""Our float32 kernel over 16-bit weights (``backends/half_linear.c``): the products and sums of a float32 linear over the
widened weights, a row's bits the same alone or in company (one pass, several passes, the widened-block path) and
however the columns are shared between threads; chosen for 16-bit weights computing in float32 where it runs, and
oneDNN's float32 kernel where it does not."""

from __future__ import annotations

import platform
import shutil

import pytest
import torch

from quasar_deploy.cpu import half_linear, linears, native
from quasar_deploy.model import Linear

runs_here = pytest.mark.skipif(
    half_linear.why_not() is not None, reason=f"the quasar-half kernel does not run here: {half_linear.why_not()}"
)
FORMATS = [torch.bfloat16, torch.float16]


def _layer(out_features: int, in_features: int, rows: int, dtype: torch.dtype, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator).to(dtype)
    return weight, torch.randn(out_features, generator=generator), torch.randn(rows, in_features, generator=generator)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or shutil.which("cc") is None, reason="x86 with a C compiler")
def test_it_runs_on_every_x86_cpu_this_project_has():
    """AVX2, FMA and F16C: every CPU kind of this project has them, so the kernel is tested on every kind."""
    assert half_linear.why_not() is None


@runs_here
@pytest.mark.parametrize("dtype", FORMATS)
@pytest.mark.parametrize(
    ("out_features", "in_features", "rows"), [(37, 70, 1), (48, 64, 6), (1000, 333, 13), (17, 5, 20), (4096, 1024, 48)]
)
def test_it_computes_the_float32_linear_over_the_widened_weights(dtype, out_features, in_features, rows):
    weight, bias, x = _layer(out_features, in_features, rows, dtype)
    got = half_linear.HalfWeightLinear(weight, bias)(x)
    expected = x.double() @ weight.double().T + bias.double()
    # float32 sums of in_features products: within a few units of float32 rounding of the largest partial sum
    bound = 4 * in_features * torch.finfo(torch.float32).eps * (x.abs().double() @ weight.abs().double().T + bias.abs().double())
    assert got.dtype == torch.float32 and got.shape == (rows, out_features)
    assert bool(((got.double() - expected).abs() <= bound).all())


@runs_here
@pytest.mark.parametrize("dtype", FORMATS)
def test_a_rows_bits_are_its_own_whatever_the_rows_and_threads(dtype, monkeypatch):
    """One row alone (one pass over the 16-bit weights), among 5 (still one pass), among 50 (several passes over a
    widened copy), in shares of one block each on 1 to 5 threads: the same bits, as batched serving and lossless
    verification need."""
    weight, bias, x = _layer(300, 256, 50, dtype, seed=1)
    alone = torch.cat([half_linear.HalfWeightLinear(weight, bias)(row[None]) for row in x])
    monkeypatch.setattr(native, "MIN_SHARE_BYTES", 1)  # every block a share of its own where threads allow
    linear = half_linear.HalfWeightLinear(weight, bias)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2, 3, 5):
            torch.set_num_threads(count)
            assert torch.equal(linear(x), alone)
            assert torch.equal(linear(x[:5]), alone[:5])
    finally:
        torch.set_num_threads(threads)


@runs_here
@pytest.mark.parametrize("dtype", FORMATS)
def test_a_16bit_weight_computing_float32_runs_on_it_and_keeps_its_width(dtype):
    weight, bias, x = _layer(40, 64, 3, dtype)
    layer = Linear(weight.clone(), bias.to(dtype), dtype=torch.float32)
    layer.prepare("onednn")
    assert isinstance(layer._fn, half_linear.HalfWeightLinear)
    assert layer.weight.is_meta and layer.weight.dtype == dtype  # released: the kernel holds it, as stored
    assert torch.equal(layer(x), half_linear.HalfWeightLinear(weight, bias.to(dtype).float())(x))


@pytest.mark.parametrize(
    ("stored", "dtype", "float_kernel"),
    [
        (torch.float32, torch.float32, "onednn"),  # nothing to widen
        (torch.bfloat16, torch.bfloat16, "onednn"),  # a CPU computing bf16: oneDNN's bf16 kernel
        (torch.bfloat16, torch.float32, "torch"),  # plain F.linear asked for
    ],
)
def test_other_weights_stay_on_the_library_kernels(stored, dtype, float_kernel):
    assert not linears.half_weights(stored, dtype, float_kernel)


def test_where_it_does_not_run_onednn_packs_the_widened_weight(monkeypatch):
    monkeypatch.setattr(half_linear, "library", lambda: (None, "no C compiler (cc) on PATH"))
    weight, bias, x = _layer(40, 64, 3, torch.bfloat16)
    assert not linears.half_weights(torch.bfloat16, torch.float32, "onednn")
    layer = Linear(weight.clone(), None, dtype=torch.float32)
    layer.prepare("onednn")
    assert not isinstance(layer._fn, half_linear.HalfWeightLinear)
    assert torch.allclose(layer(x), x @ weight.float().T, rtol=1e-5, atol=1e-5)


def test_it_refuses_a_weight_it_does_not_widen():
    if half_linear.why_not() is not None:
        pytest.skip(half_linear.why_not())
    with pytest.raises(ValueError, match="bf16 or float16"):
        half_linear.HalfWeightLinear(torch.zeros(4, 4), None)
