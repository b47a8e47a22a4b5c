"""SmoothQuant with a searched alpha, folded offline into the preceding norm or linear.

Per input channel ``s = max|X|^alpha / max|W|^(1-alpha)``; the layer sees ``X / s`` and ``W * s``. Alpha is chosen per
group by the quantized output error on calibration rows, "off" competing, so smoothing is never chosen when it hurts."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model import Linear, RMSNorm
from ..scheme import QMAX, per_token_scale, quantize_activation, weight_scale

ALPHA_GRID = tuple(round(0.05 * i, 2) for i in range(21))


@dataclass
class SearchResult:
    alpha: float | None  # None: no smoothing
    scales: torch.Tensor | None
    error_before: float  # relative output error, quantized without smoothing
    error_after: float  # relative output error at the chosen alpha
    layer_errors: dict[str, float]  # per linear, at the chosen alpha


def smoothing_scales(absmax: torch.Tensor, weights: list[torch.Tensor], alpha: float) -> torch.Tensor:
    w_max = torch.stack([w.abs().amax(dim=0) for w in weights]).amax(dim=0).clamp(min=1e-5)
    return (absmax.clamp(min=1e-5).pow(alpha) / w_max.pow(1 - alpha)).clamp(min=1e-5)


def _dequantized_weight(weight: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    """``scheme.quantize_weight(weight * scales)`` dequantized, value for value, in one new tensor modified in place."""
    w = weight * scales if scales is not None else weight.clone()
    scale = weight_scale(w)
    return w.div_(scale).round_().clamp_(-QMAX, QMAX).mul_(scale)


def group_errors(
    rows: torch.Tensor,
    absmax: torch.Tensor,
    weights: dict[str, torch.Tensor],
    scales: torch.Tensor | None,
    static: bool,
    references: dict[str, torch.Tensor],
) -> dict[str, float]:
    """Relative output error per linear; ``references`` are the float outputs ``rows @ weight.T``, the same for every alpha."""
    x = rows if scales is None else rows / scales
    s = torch.ones_like(absmax) if scales is None else scales
    scale = (absmax / s).max().clamp(min=1e-12).reshape(1, 1) / QMAX if static else per_token_scale(x)
    xq = quantize_activation(x, scale) * scale  # the scheme's W8A8 input, dequantized in float32 (the search only ranks)
    errors = {}
    for name, weight in weights.items():
        reference, quantized = references[name], xq @ _dequantized_weight(weight, scales).t()
        errors[name] = float((quantized - reference).pow(2).sum() / reference.pow(2).sum().clamp(min=1e-30))
    return errors


def _total(errors: dict[str, float]) -> float:
    return sum(errors.values()) / max(1, len(errors))


def search(
    rows: torch.Tensor, absmax: torch.Tensor, weights: dict[str, torch.Tensor], alpha: str | float, static: bool, smoothable: bool
) -> SearchResult:
    """``alpha``: "auto" (grid search, "off" included), "off", or a fixed float."""
    references = {name: rows @ weight.t() for name, weight in weights.items()}
    before = group_errors(rows, absmax, weights, None, static, references)
    if not smoothable or alpha == "off":
        candidates = [None]
    else:
        candidates = [None, *ALPHA_GRID] if alpha == "auto" else [float(alpha)]
    best: tuple[float, float | None, torch.Tensor | None, dict[str, float]] | None = None
    for candidate in candidates:
        scales = None if candidate is None else smoothing_scales(absmax, list(weights.values()), candidate)
        errors = before if candidate is None else group_errors(rows, absmax, weights, scales, static, references)
        if best is None or _total(errors) < best[0]:
            best = (_total(errors), candidate, scales, errors)
    _, chosen, scales, errors = best
    return SearchResult(chosen, scales, _total(before), _total(errors), errors)


@torch.no_grad()
def fold(source: RMSNorm | Linear, targets: list[Linear], scales: torch.Tensor) -> None:
    """Divide the source's output channels by ``s`` and multiply the targets' input columns by it."""
    if isinstance(source, RMSNorm):
        source.weight.div_(scales.to(source.weight.dtype))
    else:
        source.weight.div_(scales.to(source.weight.dtype)[:, None])
        if source.bias is not None:
            source.bias.div_(scales.to(source.bias.dtype))
    for target in targets:
        target.weight.mul_(scales.to(target.weight.dtype)[None, :])
