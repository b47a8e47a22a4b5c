"""Calibration one decoder layer at a time: memory holds one float32 layer and the calibration hidden states, never the model.

Folds stay within a layer, and each layer's inputs are the previous one's float outputs, computed before smoothing:
the artifact is bit-exact to a whole-model calibration's."""

from __future__ import annotations

import dataclasses
from functools import partial

import torch
from tqdm import tqdm

from ..artifact import HEAD, ArtifactWriter, ModelFiles
from ..decoder_spec import DecoderSpec, rope_inv_freq
from ..errors import QuasarError
from ..model import DecoderLayer, KVCache, Linear, check_finite, rotary, segment, tensor_loader
from . import stats
from .fold import Folded, search_and_fold
from .head import write_int8_head
from .quantize import quantize_layers
from .recipe import CalibrationRecipe

EMBEDDINGS = "model.embed_tokens.weight"


def embed(source: ModelFiles, samples: list[list[int]], device: torch.device) -> list[torch.Tensor]:
    """Each sample's float32 embeddings, from the table rows of the tokens the samples use (not the whole table)."""
    tokens = sorted({token for sample in samples for token in sample})
    if tokens[0] < 0 or tokens[-1] >= source.spec.vocab_size:
        bad, vocab = tokens[0] if tokens[0] < 0 else tokens[-1], source.spec.vocab_size
        raise QuasarError(f"token id {bad} of the calibration data is outside the vocabulary ({vocab}): tokenizer and weights disagree")
    table = source.checkpoint.rows(EMBEDDINGS, tokens)
    check_finite(EMBEDDINGS, table)
    table = table.to(device, torch.float32)
    known = torch.tensor(tokens, device=device)
    return [table[torch.searchsorted(known, torch.tensor(sample, device=device))] for sample in samples]


@torch.inference_mode()
def run_layer(layer: DecoderLayer, spec: DecoderSpec, hidden: list[torch.Tensor], inv_freq: torch.Tensor) -> None:
    """Replace each sample's hidden states by ``layer``'s output, as a prefill of the whole decoder computes it."""
    one_layer = dataclasses.replace(spec, num_layers=1)
    for s, x in enumerate(hidden):
        length = x.shape[0]
        cos, sin = rotary(inv_freq, 0, length, torch.float32)
        cache = KVCache(one_layer, torch.float32, x.device, length)
        hidden[s] = layer(x, cos, sin, [segment(spec, cache, length, x.device)], 0)


def calibrate_layers(
    source: ModelFiles,
    samples: list[list[int]],
    recipe: CalibrationRecipe,
    kept: dict[str, str],
    writer: ArtifactWriter,
    device: torch.device,
    progress: bool = True,
) -> tuple[Folded, list[str]]:
    """Calibrate and write every layer in turn; returns the decisions for the manifest and the quantized names, in order."""
    spec = source.spec
    groups = spec.smooth_groups()
    picks = stats.row_picks(groups, [len(s) for s in samples])
    hidden = embed(source, samples, device)
    inv_freq = rope_inv_freq(spec).to(device)
    load = tensor_loader(source.checkpoint, torch.float32)
    searched, decisions, quantized = [], {}, []
    writer.copy(EMBEDDINGS)
    for i in tqdm(range(spec.num_layers), desc="calibrating", unit="layer", disable=not progress):
        prefix = spec.layer_prefix(i)
        layer = DecoderLayer(spec, load, prefix).to(device)
        modules = {f"{prefix}.{name}" if name else prefix: module for name, module in layer.named_modules()}
        layer_groups = [g for g in groups if g.name.startswith(prefix + ".")]
        group_stats = stats.collect(modules, layer_groups, picks, partial(run_layer, layer, spec, hidden, inv_freq))
        folded = search_and_fold(modules, layer_groups, group_stats, kept, recipe)
        quantized += quantize_layers(((n, m) for n, m in modules.items() if isinstance(m, Linear)), folded.layers)
        for name, tensor in layer.state_dict(prefix=prefix + ".").items():
            writer.add(name, tensor)
        searched += folded.groups
        decisions |= folded.layers
        del layer, modules, group_stats  # before the next layer loads: one layer in memory, not two
    writer.copy("model.norm.weight")
    if recipe.int8_lm_head:
        decisions[HEAD] = write_int8_head(source, writer, hidden, recipe.activation == "static")
        quantized.append(HEAD)
    elif not spec.tie_word_embeddings:
        writer.copy("lm_head.weight")
    return Folded(searched, decisions), quantized
