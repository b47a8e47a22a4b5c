"""The C kernel's row-wise ops in the torch decoder (``decoder_ops.TorchRows``, ``Decoder.row_kernel``): RMSNorm and
the SiLU gate against torch's, in float32 and bf16, for every build that runs here (AVX-512 and AVX2 on a CPU with
both); a row's bits whatever its company and however the rows are shared between threads; bound and unbound with the
attention kernel."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from quasar_deploy.artifact import open_model_files
from quasar_deploy.backends.torch_backend import load_cpu
from quasar_deploy.cpu import decoder_ops
from quasar_deploy.model import RMSNorm

from .test_cpu_attention import kernel  # noqa: F401  (the fixture: each build that runs here)

needs_kernel = pytest.mark.skipif(decoder_ops.load() is None, reason="no build of the C kernel runs on this CPU (doctor says why)")


@pytest.fixture
def rows(kernel) -> decoder_ops.TorchRows:  # noqa: F811
    return decoder_ops.TorchRows(kernel, torch.get_num_threads())


def random_rows(rows: int, width: int, seed: int = 0) -> torch.Tensor:
    # a width past whole vectors (16 and 8 floats) exercises the scalar tail
    return 3 * torch.randn(rows, width, generator=torch.Generator().manual_seed(seed))


@needs_kernel
@pytest.mark.parametrize("width", [64, 1027])
def test_rms_norm_is_torchs_within_float32_rounding(rows, width):
    x = random_rows(7, width)
    norm = RMSNorm(torch.rand(width, generator=torch.Generator().manual_seed(1)) + 0.5, 1e-6)
    torch.testing.assert_close(rows.rms_norm(x, norm), norm(x), rtol=2e-6, atol=1e-6)


@needs_kernel
@pytest.mark.parametrize("width", [64, 1027])
def test_the_silu_gate_is_torchs_within_float32_rounding(rows, width):
    gate_up = random_rows(7, 2 * width, seed=2)  # gates from about -12 to 12: both sides of exp's argument
    gate, up = gate_up.split(width, dim=-1)
    torch.testing.assert_close(rows.silu_gate(gate_up), F.silu(gate) * up, rtol=5e-6, atol=1e-6)


@needs_kernel
def test_bf16_rows_come_back_in_bf16_within_its_rounding(rows):
    x = random_rows(5, 96).bfloat16()
    norm = RMSNorm((torch.rand(96) + 0.5).bfloat16(), 1e-6)
    normed, gated = rows.rms_norm(x, norm), rows.silu_gate(torch.cat([x, x], dim=-1))
    assert normed.dtype == gated.dtype == torch.bfloat16
    torch.testing.assert_close(normed.float(), norm(x).float(), rtol=1.6e-2, atol=1e-2)
    torch.testing.assert_close(gated.float(), (F.silu(x.float()) * x.float()), rtol=1.6e-2, atol=1e-2)


@needs_kernel
def test_bf16_rows_are_the_float32_results_rounded_once(rows):
    """A bf16 decoder's rows are read and written as bf16 by the kernel (no conversion ops around the call): the bits
    of the float32 path on the same values, rounded to bf16 as torch rounds."""
    x = random_rows(9, 1027, seed=4).bfloat16()
    norm = RMSNorm((torch.rand(1027) + 0.5).bfloat16(), 1e-6)
    assert torch.equal(rows.rms_norm(x, norm), rows.rms_norm(x.float(), norm).bfloat16())
    gate_up = torch.cat([x, x.flip(0)], dim=-1)
    assert torch.equal(rows.silu_gate(gate_up), rows.silu_gate(gate_up.float()).bfloat16())


@needs_kernel
def test_a_rows_bits_do_not_depend_on_its_company_or_the_threads(rows, monkeypatch):
    """A server's step stacks many sequences' rows, and a prompt's hundreds of rows are shared between threads: each
    row's result is the bits it gets alone."""
    x = random_rows(48, 256, seed=3)
    norm = RMSNorm(torch.rand(256) + 0.5, 1e-6)
    together = rows.rms_norm(x, norm), rows.silu_gate(torch.cat([x, x.flip(0)], dim=-1))
    monkeypatch.setattr(decoder_ops, "ROW_SHARE_FLOATS", 1)  # every call shared, whatever its size
    shared = rows.rms_norm(x, norm), rows.silu_gate(torch.cat([x, x.flip(0)], dim=-1))
    for all_rows, shared_rows in zip(together, shared):
        assert torch.equal(all_rows, shared_rows)
    for i in (0, 17, 47):
        assert torch.equal(rows.rms_norm(x[i : i + 1], norm)[0], together[0][i])
        assert torch.equal(rows.silu_gate(torch.cat([x, x.flip(0)], dim=-1)[i : i + 1])[0], together[1][i])


@needs_kernel
def test_the_row_ops_are_bound_with_the_attention_kernel(tiny_qwen3):
    assert isinstance(load_cpu(open_model_files(tiny_qwen3)).decoder.row_kernel, decoder_ops.TorchRows)
    assert load_cpu(open_model_files(tiny_qwen3), attention="torch").decoder.row_kernel is None


def test_without_a_kernel_the_decoder_keeps_torchs_ops(tiny_qwen3, monkeypatch):
    monkeypatch.setattr(decoder_ops, "load", lambda dim=None: None)  # a CPU no build runs on, or no compiler
    decoder = load_cpu(open_model_files(tiny_qwen3)).decoder
    assert decoder.row_kernel is None and decoder.attention_kernel is None
