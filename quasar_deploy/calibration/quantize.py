"""Calibration's second phase: quantize the linears the first phase kept in int8, once every fold is done."""

from __future__ import annotations

import torch

from ..model import Decoder, Linear
from ..scheme import QMAX, quantize_weight
from .fold import LayerDecision


def quantize_layers(decoder: Decoder, layers: dict[str, LayerDecision]) -> list[str]:
    """Quantize ``decoder`` in place; returns the quantized names in the decoder's order (the manifest's ``quantized_layers``)."""
    quantized = []
    for name, linear in decoder.linears():
        if layers[name].quantized:
            _quantize(linear, layers[name].static_absmax)
            quantized.append(name)
    return quantized


@torch.no_grad()
def _quantize(linear: Linear, input_absmax: torch.Tensor | None) -> None:
    wq, w_scale = quantize_weight(linear.weight.data)
    input_scale = None if input_absmax is None else (input_absmax.max().clamp(min=1e-12) / QMAX).reshape(1)
    linear.set_quantized(wq, w_scale, input_scale)
