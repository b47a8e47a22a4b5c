"""``calibrate``: float checkpoint in, canonical W8A8 artifact out.

The steps: ``recipe``, ``data``, ``layerwise`` (per layer: ``stats``, ``fold``, ``quantize``), ``manifest``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..artifact import ModelFiles, open_model_files, writing_artifact
from ..errors import QuasarError
from ..files import require_new
from ..shards import MAX_SHARD_SIZE
from ..tokenizer import load_tokenizer
from . import data
from .device import calibration_device
from .fold import keep_float_matches
from .layerwise import calibrate_layers
from .manifest import build_manifest
from .recipe import CalibrationRecipe


def calibrate(
    model_dir: str | Path,
    output: str | Path,
    *,
    recipe: CalibrationRecipe | None = None,
    trust_remote_code: bool = False,
    progress: bool = True,
    device: str = "cpu",
    max_shard_size: int = MAX_SHARD_SIZE,
    **options: Any,
) -> ModelFiles:
    """Calibrate ``model_dir`` (a local HF checkpoint) into a W8A8 artifact at ``output``; returns it opened.

    Give either ``recipe`` or its fields as keywords; ``device`` runs the forward passes, statistics and alpha search."""
    if recipe is not None and options:
        raise QuasarError(f"give calibrate() a recipe or its fields as keywords, not both (got recipe= and {', '.join(options)})")
    recipe = CalibrationRecipe(**options) if recipe is None else recipe
    output = require_new(output)
    source = open_model_files(model_dir)
    if source.is_artifact:
        raise QuasarError(f"{source.path}: is already a W8A8 artifact; calibrate the float checkpoint it came from")
    tokenizer = load_tokenizer(source, trust_remote_code)
    samples = data.calibration_samples(tokenizer, recipe.calib_data, recipe.num_samples, recipe.seq_len)

    kept = keep_float_matches(source.spec.linear_names(), recipe.keep_float)
    where = calibration_device(device)
    with writing_artifact(source.checkpoint, output, max_shard_size) as writer:
        folded, quantized_layers = calibrate_layers(source, samples, recipe, kept, writer, where, progress)
        float_linears = [name for name, layer in folded.layers.items() if not layer.quantized]
        writer.finish(recipe.scheme, float_linears, build_manifest(source, recipe, samples, folded, quantized_layers))
    return open_model_files(output)


__all__ = ["CalibrationRecipe", "calibrate"]
