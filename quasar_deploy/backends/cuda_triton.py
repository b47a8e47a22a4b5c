"""The fused activation quantization of the cuda backend: one Triton kernel per call, imported only on a CUDA machine.

One program per row, written into a block already of the GEMM's padded shape; ``div_rn`` (Triton's ``/`` is
approximate) and ``_round_half_even`` give ``cuda_linear.quantize_rows_torch``'s integers (a GPU test compares).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..scheme import QMAX

BLOCK = 1024


@triton.jit
def _round_half_even(y):
    """torch.round: ``y - floor(y)`` is exact in float32, so the fraction decides, ties going to the even neighbour."""
    low = tl.floor(y)
    fraction = y - low
    odd = (low - 2.0 * tl.floor(low * 0.5)) == 1.0
    up = (fraction > 0.5) | ((fraction == 0.5) & odd)
    return tl.where(up, low + 1.0, low)


@triton.jit
def _quantize_rows(x_ptr, q_ptr, scale_ptr, cols, x_stride, q_stride, STATIC: tl.constexpr, BLOCK: tl.constexpr, QMAX: tl.constexpr):
    row = tl.program_id(0)
    offsets = tl.arange(0, BLOCK)
    if STATIC:
        scale = tl.load(scale_ptr)
    else:
        peak = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, cols, BLOCK):
            index = start + offsets
            v = tl.load(x_ptr + row * x_stride + index, mask=index < cols, other=0.0).to(tl.float32)
            peak = tl.maximum(peak, tl.abs(v))
        scale = tl.maximum(tl.div_rn(tl.max(peak, axis=0), QMAX * 1.0), 1e-12)
        tl.store(scale_ptr + row, scale)
    for start in range(0, cols, BLOCK):
        index = start + offsets
        v = tl.load(x_ptr + row * x_stride + index, mask=index < cols, other=0.0).to(tl.float32)
        q = _round_half_even(tl.div_rn(v, scale))
        q = tl.minimum(tl.maximum(q, -QMAX * 1.0), QMAX * 1.0)
        tl.store(q_ptr + row * q_stride + index, q.to(tl.int8), mask=index < cols)


def quantize_rows_triton(x: torch.Tensor, input_scale: torch.Tensor | None, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``cuda_linear.Quantizer`` on a CUDA tensor ``x`` [M, K] (contiguous rows): int8 [rows, cols], and the scale."""
    m, k = x.shape
    padded = (rows, cols) != (m, k)
    q = (torch.zeros if padded else torch.empty)(rows, cols, dtype=torch.int8, device=x.device)
    scale = input_scale if input_scale is not None else torch.empty(m, 1, dtype=torch.float32, device=x.device)
    _quantize_rows[(m,)](x, q, scale, k, x.stride(0), q.stride(0), STATIC=input_scale is not None, BLOCK=BLOCK, QMAX=QMAX)
    return q, scale
