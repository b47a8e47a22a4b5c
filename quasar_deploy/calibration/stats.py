"""Activation statistics of a layer's smoothing groups, collected while the calibration hidden states pass through it.

Per group: the per-channel max |x| over all tokens, and sampled input rows for the alpha search, drawn up front
(``row_picks``) so a layer-by-layer pass samples the rows a whole-model pass would."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..decoder_spec import SmoothGroup
from ..errors import QuasarError

ROWS_PER_GROUP = 256


@dataclass
class GroupStats:
    absmax: torch.Tensor  # [in_features], max |x| over all calibration tokens
    rows: torch.Tensor  # [n, in_features], sampled input rows


def row_picks(groups: list[SmoothGroup], lengths: list[int], rows_per_group: int = ROWS_PER_GROUP) -> dict[str, list[torch.Tensor]]:
    """Group name -> per sample, the indices of the rows to keep (``groups`` in the order a forward pass meets them)."""
    per_sample = max(1, -(-rows_per_group // max(1, len(lengths))))
    generator = torch.Generator().manual_seed(0)
    picks: dict[str, list[torch.Tensor]] = {g.name: [] for g in groups}
    for length in lengths:
        for group in groups:
            picks[group.name].append(torch.randperm(length, generator=generator)[:per_sample].clone())
    return picks


def collect(
    modules: dict[str, nn.Module], groups: list[SmoothGroup], picks: dict[str, list[torch.Tensor]], run: Callable[[], None]
) -> dict[str, GroupStats]:
    """Statistics of ``groups``' inputs (linears in ``modules``, by full name) while ``run()`` pushes every sample through, in order."""
    absmax: dict[str, torch.Tensor] = {}
    rows: dict[str, list[torch.Tensor]] = {g.name: [] for g in groups}

    def hook_for(name: str):
        def hook(_module, args):
            x = args[0].reshape(-1, args[0].shape[-1]).float()
            m = x.abs().amax(dim=0)
            absmax[name] = m if name not in absmax else torch.maximum(absmax[name], m)
            rows[name].append(x[picks[name][len(rows[name])].to(x.device)])

        return hook

    handles = [modules[g.linears[0]].register_forward_pre_hook(hook_for(g.name)) for g in groups]
    try:
        run()
    finally:
        for handle in handles:
            handle.remove()
    for group in groups:
        if not torch.isfinite(absmax[group.name]).all():
            raise QuasarError(f"{group.linears[0]}: its calibration inputs hold NaN or infinity (the float model overflows on this data)")
    return {g.name: GroupStats(absmax[g.name], torch.cat(rows[g.name])[:ROWS_PER_GROUP]) for g in groups}
