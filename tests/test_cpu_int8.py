"""Our AVX-512 VNNI int8 kernel (``backends/cpu_int8.c``): bit for bit the scheme's reference linear at any shape, a row
alone or in company and however the columns are shared between threads; and offered only where its self-check runs."""

from __future__ import annotations

import subprocess

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quasar_deploy import kernels, openmp
from quasar_deploy.backends import cpu_int8, native
from quasar_deploy.errors import QuasarError
from quasar_deploy.scheme import quantize_weight

runs_here = pytest.mark.skipif(cpu_int8.why_not() is not None, reason=f"our VNNI kernel does not run here: {cpu_int8.why_not()}")


def _layer(out_features: int, in_features: int, rows: int, seed: int, bias: bool):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator)
    x = torch.randn(rows, in_features, generator=generator) * 3
    x[:, : min(2, in_features)] *= 50  # outlier channels: codes at +-127 in every row
    wq, scale = quantize_weight(weight)
    return wq, scale, (torch.randn(out_features, generator=generator) if bias else None), x


def _both(wq, scale, bias, input_scale, x):
    expected = kernels.int8_linear(wq, scale, bias, input_scale, "reference")(x)
    return expected, kernels.int8_linear(wq, scale, bias, input_scale, "quasar-vnni")(x)


@runs_here
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    out_features=st.integers(1, 200),
    in_features=st.integers(1, 300),
    rows=st.integers(1, 20),
    static=st.booleans(),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_the_kernel_is_the_reference_at_any_shape(out_features, in_features, rows, static, bias, seed):
    """Column counts off the 64-column blocks, depths off the 4-value groups, row counts off the 6-row passes."""
    wq, scale, b, x = _layer(out_features, in_features, rows, seed, bias)
    input_scale = (x.abs().max() / 127).reshape(1) if static else None
    expected, got = _both(wq, scale, b, input_scale, x)
    assert torch.equal(got, expected)


@runs_here
def test_extreme_codes_and_deep_rows_sum_exactly():
    """Full-range codes at K = 12288 (sums past 2^24, where float32 rounds them: as the reference's ``.float()`` does)."""
    k = 12288
    wq = torch.full((70, k), 127, dtype=torch.int8)
    wq[1::2] = -127
    wq[5, ::3] = 0
    x = torch.ones(3, k)
    x[1, ::2] = -1
    expected, got = _both(wq, torch.full((70, 1), 1e-3), None, None, x)
    assert expected.abs().max() > 2**24 * 1e-3 / 127 and torch.equal(got, expected)


@runs_here
def test_a_rows_bits_do_not_depend_on_its_company_or_the_threads(monkeypatch):
    """Shares of one block each, as many as 5 threads, in torch's OpenMP pool and on Python threads."""
    wq, scale, bias, x = _layer(1000, 520, 17, 0, True)
    linear = kernels.int8_linear(wq, scale, bias, None, "quasar-vnni")
    together = linear(x)
    monkeypatch.setattr(cpu_int8, "MIN_SHARE_BYTES", 1)  # every block a share of its own where threads allow
    monkeypatch.setattr(cpu_int8, "ROWS_PER_SHARE", 1)
    threads, lib = torch.get_num_threads(), cpu_int8.library()[0]
    runtime = openmp.parallel_entry_points()
    try:
        for handed in (runtime, None):  # shares in torch's OpenMP pool, and on threads of our own where there is none
            lib.quasar_int8_use_openmp(*(handed or (None, None, None)))
            for count in (1, 2, 3, 5):
                torch.set_num_threads(count)
                split = kernels.int8_linear(wq, scale, bias, None, "quasar-vnni")
                assert torch.equal(split(x), together)
                for i in (0, 6, 16):
                    assert torch.equal(split(x[i : i + 1])[0], together[i])
    finally:
        torch.set_num_threads(threads)
        lib.quasar_int8_use_openmp(*(runtime or (None, None, None)))


@pytest.fixture
def fresh_probe(monkeypatch, tmp_path):
    """The kernel built into an empty cache and probed anew; the next caller probes this CPU itself again."""
    monkeypatch.setenv("QUASAR_CACHE", str(tmp_path))
    monkeypatch.delenv(native.PREBUILT_ENV, raising=False)
    cpu_int8.library.cache_clear()
    kernels.int8_probe.cache_clear()
    yield
    cpu_int8.library.cache_clear()
    kernels.int8_probe.cache_clear()


def test_a_build_that_fails_its_self_check_is_not_offered(fresh_probe, monkeypatch):
    real_run = subprocess.run

    def run(command, **kwargs):
        if "quasar_probe" in command[-1] and "cpu_int8" in command[-1]:  # the child that runs the build's self-check
            return subprocess.CompletedProcess(command, -4)  # as a SIGILL would end it
        return real_run(command, **kwargs)

    monkeypatch.setattr(native.subprocess, "run", run)
    assert "failed its self-check (exit -4)" in cpu_int8.why_not()
    assert not kernels.quasar_int8_available() and "quasar-vnni" not in kernels.int8_probe().ms
    with pytest.raises(QuasarError, match="the quasar-vnni kernel does not run here: .*self-check"):
        kernels.check_int8_kernel("quasar-vnni")


def test_without_a_compiler_the_kernel_is_not_offered(fresh_probe, monkeypatch):
    monkeypatch.setenv("CC", "no-such-compiler")
    assert "no C compiler (no-such-compiler)" in cpu_int8.why_not()
    assert kernels.default_int8_kernel("cpu") != "quasar-vnni"
