"""Calibration's second phase: quantize the linears the first phase kept in int8, once every fold of their layer is done."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..model import Linear
from ..scheme import QMAX, quantize_weight
from .fold import LayerDecision


@torch.no_grad()
def quantize_layers(linears: Iterable[tuple[str, Linear]], layers: dict[str, LayerDecision]) -> list[str]:
    """Quantize ``linears`` in place; returns the quantized names in their order (the manifest's ``quantized_layers``)."""
    quantized = []
    for name, linear in linears:
        if layers[name].quantized:
            absmax = layers[name].static_absmax
            wq, w_scale = quantize_weight(linear.weight.data)
            linear.set_quantized(wq, w_scale, None if absmax is None else static_input_scale(absmax))
            quantized.append(name)
    return quantized


def static_input_scale(input_absmax: torch.Tensor) -> torch.Tensor:
    """The one activation scale of a static linear: the largest |x| of its calibration inputs over 127, shape [1]."""
    return (input_absmax.max().clamp(min=1e-12) / QMAX).reshape(1)
