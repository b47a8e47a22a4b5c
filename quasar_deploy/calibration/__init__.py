"""``calibrate``: float checkpoint in, canonical W8A8 artifact out.

The steps live in their own modules: ``recipe`` (what to do, validated), ``data`` and
``stats`` (one float pass over the calibration set), ``fold`` (alpha search and folding),
``quantize``, ``manifest``; this module only runs them in order.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..artifact import ModelFiles, open_model_files, write_artifact
from ..errors import QuasarError
from ..files import require_new
from ..tokenizer import load_tokenizer
from . import data, stats
from .fold import keep_float_matches, search_and_fold
from .manifest import build_manifest
from .quantize import quantize_layers
from .recipe import CalibrationRecipe


def calibrate(
    model_dir: str | Path,
    output: str | Path,
    *,
    recipe: CalibrationRecipe | None = None,
    trust_remote_code: bool = False,
    progress: bool = True,
    **options: Any,
) -> ModelFiles:
    """Calibrate ``model_dir`` (a local HF checkpoint) into a W8A8 artifact at ``output``; returns it opened.

    Give either ``recipe`` or its fields as keywords (``alpha="auto"``, ``num_samples=64``, ...),
    the form earlier versions took; see ``CalibrationRecipe``.
    """
    if recipe is not None and options:
        raise QuasarError(f"give calibrate() a recipe or its fields as keywords, not both (got recipe= and {', '.join(options)})")
    if recipe is None:
        recipe = CalibrationRecipe(**options)
    output = require_new(output)
    source = open_model_files(model_dir)
    if source.is_artifact:
        raise QuasarError(f"{source.path}: is already a W8A8 artifact; calibrate the float checkpoint it came from")
    tokenizer = load_tokenizer(source.path, trust_remote_code)
    samples = data.calibration_samples(tokenizer, recipe.calib_data, recipe.num_samples, recipe.seq_len)

    decoder = source.decoder(torch.float32)
    decoder.prepare("torch", "reference")
    kept = keep_float_matches(decoder, recipe.keep_float)
    groups = source.spec.smooth_groups()
    group_stats = stats.collect(decoder, groups, samples, progress=progress)
    folded = search_and_fold(decoder, groups, group_stats, kept, recipe, progress=progress)
    quantized_layers = quantize_layers(decoder, folded.layers)

    manifest = build_manifest(source, recipe, samples, folded, quantized_layers)
    write_artifact(decoder, source.checkpoint, output, recipe.scheme, manifest)
    return open_model_files(output)


__all__ = ["CalibrationRecipe", "calibrate"]
