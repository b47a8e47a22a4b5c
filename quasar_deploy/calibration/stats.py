"""Activation statistics of every smoothing group's input, from one float pass over the calibration set.

Smoothing is function-preserving in float, so the statistics of the original model
are valid for every group at once: one pass suffices. Per group we keep the
per-channel max |x| over all calibration tokens and a bounded sample of input
rows for the alpha search (so memory stays small next to the model).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tqdm import tqdm

from ..decoder_spec import SmoothGroup
from ..errors import QuasarError
from ..model import Decoder


@dataclass
class GroupStats:
    absmax: torch.Tensor  # [in_features], max |x| over all calibration tokens
    rows: torch.Tensor  # [n, in_features], sampled input rows


def collect(
    decoder: Decoder, groups: list[SmoothGroup], samples: list[list[int]], rows_per_group: int = 256, progress: bool = True
) -> dict[str, GroupStats]:
    modules = dict(decoder.named_modules())
    per_sample = max(1, -(-rows_per_group // max(1, len(samples))))
    generator = torch.Generator().manual_seed(0)
    absmax: dict[str, torch.Tensor] = {}
    rows: dict[str, list[torch.Tensor]] = {g.name: [] for g in groups}
    handles = []

    def hook_for(name: str):
        def hook(_module, args):
            x = args[0].reshape(-1, args[0].shape[-1]).float()
            m = x.abs().amax(dim=0)
            absmax[name] = m if name not in absmax else torch.maximum(absmax[name], m)
            pick = torch.randperm(x.shape[0], generator=generator)[:per_sample]
            rows[name].append(x[pick].clone())

        return hook

    for group in groups:
        handles.append(modules[group.linears[0]].register_forward_pre_hook(hook_for(group.name)))
    try:
        for ids in tqdm(samples, desc="calibration pass", unit="sample", disable=not progress):
            decoder(torch.tensor(ids, dtype=torch.long), decoder.new_cache(len(ids)))
    finally:
        for handle in handles:
            handle.remove()
    for group in groups:
        if not torch.isfinite(absmax[group.name]).all():
            raise QuasarError(f"{group.linears[0]}: its calibration inputs hold NaN or infinity (the float model overflows on this data)")
    return {g.name: GroupStats(absmax[g.name], torch.cat(rows[g.name])[:rows_per_group]) for g in groups}
