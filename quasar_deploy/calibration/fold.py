"""Calibration's first phase: per smoothing group, search alpha, fold the scales in, and decide which linears stay float.

Nothing is quantized here: the o and down groups fold into v_proj and up_proj rows, so quantizing waits until every
group of a layer is folded (``quantize.py``)."""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..decoder_spec import SmoothGroup
from ..errors import QuasarError
from . import smoothing
from .recipe import CalibrationRecipe
from .stats import GroupStats


@dataclass(frozen=True)
class LayerDecision:
    """One linear's outcome: its error at the chosen alpha, why it stays float (None: quantized), its static input range."""

    error: float | None
    float_reason: str | None
    static_absmax: torch.Tensor | None  # max |x| after smoothing; only for static activations

    @property
    def quantized(self) -> bool:
        return self.float_reason is None


@dataclass(frozen=True)
class Folded:
    groups: list[tuple[SmoothGroup, smoothing.SearchResult]]
    layers: dict[str, LayerDecision]  # in smoothing-group order


def keep_float_matches(names: list[str], patterns: Sequence[str]) -> dict[str, str]:
    """Layer name -> the pattern that keeps it in float; a pattern matching nothing is an error, raised before the slow pass."""
    kept: dict[str, str] = {}
    for pattern in patterns:
        hits = [n for n in names if fnmatch.fnmatchcase(n, pattern) or fnmatch.fnmatchcase(n, "*." + pattern)]
        if not hits:
            raise QuasarError(f"--keep-float {pattern!r} matches no linear layer (names look like {names[0]})")
        for name in hits:
            kept.setdefault(name, pattern)
    return kept


def search_and_fold(
    modules: dict[str, nn.Module],
    groups: list[SmoothGroup],
    group_stats: dict[str, GroupStats],
    kept: dict[str, str],
    recipe: CalibrationRecipe,
) -> Folded:
    """Smooth ``modules`` (by full name) in place, group by group; ``kept`` (``keep_float_matches``) is left out of the search."""
    static = recipe.activation == "static"
    searched, layers = [], {}
    for group in groups:
        weights = {n: modules[n].weight.data.float() for n in group.linears if n not in kept}
        st = group_stats[group.name]
        if weights:
            result = smoothing.search(st.rows, st.absmax, weights, recipe.alpha, static, group.source is not None)
        else:
            result = smoothing.SearchResult(None, None, 0.0, 0.0, {})
        if result.scales is not None:
            smoothing.fold(modules[group.source], [modules[n] for n in group.linears], result.scales)
        input_absmax = st.absmax if result.scales is None else st.absmax / result.scales
        for name in group.linears:
            error = result.layer_errors.get(name)
            reason = f"keep-float pattern {kept[name]!r}" if name in kept else None
            if reason is None and recipe.keep_float_above is not None and error is not None and error > recipe.keep_float_above:
                reason = f"error {error:.3g} above {recipe.keep_float_above:g}"
            layers[name] = LayerDecision(error, reason, input_absmax if static else None)
        searched.append((group, result))
    return Folded(searched, layers)
