"""The int8 lm_head (``CalibrationRecipe.int8_lm_head``): quantized like every W8A8 linear, written block by block.

On a small model the float head is most of what a W8A8 step reads. No smoothing: its alpha search would hold the whole
float head, past calibration's one-layer memory bound. A tied head gets its own int8 copy under ``lm_head.weight``."""

from __future__ import annotations

import torch

from ..artifact import HEAD, ArtifactWriter, ModelFiles, checked_row_blocks
from ..model import RMSNorm, tensor_loader
from ..scheme import per_token_scale, quantize_activation, quantize_weight
from .fold import LayerDecision
from .quantize import static_input_scale
from .stats import ROWS_PER_GROUP


@torch.inference_mode()
def write_int8_head(source: ModelFiles, writer: ArtifactWriter, hidden: list[torch.Tensor], static: bool) -> LayerDecision:
    """Quantize the head block by block into ``writer`` (``hidden``: the last layer's outputs); returns its decision."""
    absmax, rows = _head_inputs(source, hidden)
    input_scale = static_input_scale(absmax) if static else None
    act_scale = per_token_scale(rows) if input_scale is None else input_scale.cpu().reshape(1, 1)
    quantized_rows = quantize_activation(rows, act_scale) * act_scale
    name = "model.embed_tokens.weight" if source.spec.tie_word_embeddings else f"{HEAD}.weight"  # a tied head's table
    scales, error, reference = [], torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)

    def blocks():
        nonlocal error, reference
        for block in checked_row_blocks(source.checkpoint, name):
            wq, scale = quantize_weight(block)
            exact = rows @ block.float().t()
            error += (quantized_rows @ (wq.float() * scale).t() - exact).double().pow(2).sum()
            reference += exact.double().pow(2).sum()
            scales.append(scale)
            yield wq

    writer.shards.add_blocks(f"{HEAD}.weight", torch.int8, source.checkpoint.shapes[name], blocks())
    writer.add(f"{HEAD}.weight_scale", torch.cat(scales))
    if input_scale is not None:
        writer.add(f"{HEAD}.input_scale", input_scale.cpu())
    return LayerDecision(float(error / reference.clamp(min=1e-30)), None, None)


def _head_inputs(source: ModelFiles, hidden: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The head's inputs (the final norm of ``hidden``): their per-channel max |x| and ``ROWS_PER_GROUP`` rows, on the host."""
    norm = RMSNorm(tensor_loader(source.checkpoint, torch.float32)("model.norm.weight"), source.spec.rms_norm_eps)
    norm = norm.to(hidden[0].device)
    total = sum(len(x) for x in hidden)
    picks = torch.linspace(0, total - 1, min(total, ROWS_PER_GROUP)).long()
    absmax, rows, start = torch.zeros_like(hidden[0][0]), [], 0
    for x in hidden:
        y = norm(x)
        absmax = torch.maximum(absmax, y.abs().amax(dim=0))
        mine = picks[(picks >= start) & (picks < start + len(x))] - start
        rows.append(y[mine.to(y.device)].cpu())
        start += len(x)
    return absmax, torch.cat(rows)
