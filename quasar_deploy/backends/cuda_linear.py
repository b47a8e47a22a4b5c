"""The cuda backend's linears: W8A8 on int8 tensor cores, float in bf16, both as a ``model.KernelFactory``.

A W8A8 linear: the activations quantized to int8 (``cuda_triton.py`` on CUDA, or ``quantize_rows_torch``),
``torch._int_mm`` (integer-exact; its CUDA shape rules met by zero padding), then the reference's epilogue in float32:
bit-exact with ``scheme.reference_linear``. The device is a parameter so that tests run this code on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..cpu.linears import float_linear
from ..model import KernelFactory, LinearFn, round_up
from ..scheme import per_token_scale, quantize_activation

# (x [M, K], static scale [1, 1] or None, rows, cols) -> (int8 [rows, cols] zero-padded, activation scale [M, 1] or [1, 1])
Quantizer = Callable[[torch.Tensor, "torch.Tensor | None", int, int], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class IntMMRules:
    """The shapes ``torch._int_mm`` accepts on a device: at least ``min_rows`` rows, K and N multiples of ``multiple``."""

    min_rows: int
    multiple: int

    @staticmethod
    def for_device(device: torch.device | str) -> IntMMRules:
        return CUDA_RULES if torch.device(device).type == "cuda" else CPU_RULES

    def padded(self, rows: int, cols: int) -> tuple[int, int]:
        """(rows, cols) of an int8 activation block as the GEMM must receive it."""
        return max(rows, self.min_rows), round_up(cols, self.multiple)


CUDA_RULES = IntMMRules(min_rows=17, multiple=8)  # aten/src/ATen/native/cuda/Blas.cpp, _int_mm_out_cuda's checks
CPU_RULES = IntMMRules(min_rows=1, multiple=1)


def pad2d(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``t`` with zero rows and columns appended up to [rows, cols] (itself when nothing is missing)."""
    if t.shape == (rows, cols):
        return t
    return F.pad(t, (0, cols - t.shape[1], 0, rows - t.shape[0]))


def quantize_rows_torch(x: torch.Tensor, input_scale: torch.Tensor | None, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The scheme's activation quantization in plain torch, as int8, zero-padded to [rows, cols]."""
    scale = per_token_scale(x) if input_scale is None else input_scale
    return pad2d(quantize_activation(x, scale).to(torch.int8), rows, cols), scale


class Int8Linear:
    """One W8A8 linear on ``wq``'s device: the weight is padded to the GEMM's rules once and kept transposed ([K, N] column-major)."""

    def __init__(
        self,
        wq: torch.Tensor,
        weight_scale: torch.Tensor,
        bias: torch.Tensor | None,
        input_scale: torch.Tensor | None,
        rules: IntMMRules,
        quantize: Quantizer,
    ):
        self.out_features, self.in_features = wq.shape
        padded_out, self.cols = round_up(self.out_features, rules.multiple), round_up(self.in_features, rules.multiple)
        self.weight_t = pad2d(wq, padded_out, self.cols).t()
        self.weight_row = weight_scale.float().reshape(1, -1)
        self.bias = bias.float() if bias is not None else None
        self.input_scale = input_scale.float().reshape(1, 1) if input_scale is not None else None
        self.rules, self.quantize = rules, quantize

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        q, act_scale = self.quantize(x.contiguous(), self.input_scale, *self.rules.padded(rows, self.in_features))
        acc = torch._int_mm(q, self.weight_t)[:rows, : self.out_features]
        y = acc.float() * act_scale * self.weight_row
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype)


def device_kernels(rules: IntMMRules, quantize: Quantizer) -> KernelFactory:
    """The cuda backend's ``KernelFactory``: ``Int8Linear`` for W8A8 layers, ``F.linear`` for float ones (tensors on the device)."""

    def make(weight, weight_scale, bias, input_scale) -> LinearFn:
        if weight.dtype == torch.int8:
            return Int8Linear(weight, weight_scale, bias, input_scale, rules, quantize)
        return float_linear(weight, bias, "torch")

    return make
