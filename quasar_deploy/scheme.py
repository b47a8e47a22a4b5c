"""The W8A8 numerics, defined once: every backend and exporter is tested against this file.

Weights: int8, symmetric, one float32 scale per output channel. Activations: int8, symmetric; per token at run time
("dynamic", the default) or one calibrated scale per tensor ("static"). GEMM: int8 x int8 with integer-exact
accumulation, then ``y = acc * act_scale[:, None] * weight_scale[None, :] (+ bias)``."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal, get_args

import torch

QMAX = 127
ActivationMode = Literal["dynamic", "static"]
ACTIVATION_MODES: tuple[str, ...] = get_args(ActivationMode)


@dataclass(frozen=True)
class W8A8Scheme:
    """What a calibration produced and every backend must compute."""

    activation: ActivationMode = "dynamic"

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATION_MODES:
            raise ValueError(f"activation must be 'dynamic' or 'static', not {self.activation!r}")

    def to_dict(self) -> dict:
        return asdict(self)


def weight_scale(w: torch.Tensor) -> torch.Tensor:
    """Per output channel: rowmax|w| / 127, shape [out, 1] (max and -min rather than abs: no temporary the size of w)."""
    return (torch.maximum(w.amax(dim=1, keepdim=True), -w.amin(dim=1, keepdim=True)) / QMAX).clamp(min=1e-12)


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8; returns (int8 [out, in], float32 scale [out, 1])."""
    w = weight.float()
    scale = weight_scale(w)
    return torch.round(w / scale).clamp(-QMAX, QMAX).to(torch.int8), scale


def per_token_scale(x: torch.Tensor) -> torch.Tensor:
    """scale = rowmax|x| / 127, shape [rows, 1]; all-zero rows get a harmless tiny scale."""
    peak = x.float().abs().amax(dim=-1, keepdim=True)
    # a tensor divisor: CUDA divides by a Python scalar as a multiply by its reciprocal, an ulp off in some rows
    return (peak / torch.full_like(peak, QMAX)).clamp(min=1e-12)


def quantize_activation(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest-even, saturate to [-127, 127]; returns integer values as float32."""
    return (x.float() / scale).round_().clamp_(-QMAX, QMAX)  # one new tensor, rounded and clamped in place


def int8_matmul_int32(xq: torch.Tensor, wq: torch.Tensor) -> torch.Tensor:
    """Integer-exact accumulation of int8 x int8: float64 holds any realistic int32 sum exactly."""
    return xq.double() @ wq.double().t()


def reference_linear(
    x: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None, input_scale: torch.Tensor | None = None
) -> torch.Tensor:
    """The oracle: W8A8 linear on a 2-D input [rows, in]; dynamic when input_scale is None."""
    act_scale = per_token_scale(x) if input_scale is None else input_scale.float().reshape(1, 1)
    acc = int8_matmul_int32(quantize_activation(x, act_scale), wq)
    y = acc.float() * act_scale * w_scale.float().reshape(1, -1)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
