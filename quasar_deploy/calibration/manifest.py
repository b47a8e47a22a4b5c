"""The calibration record written to ``quasar.json``: what went in (source, recipe, data) and what each group and layer got.

Its keys are part of the artifact format: they change only with ``artifact.FORMAT_VERSION``."""

from __future__ import annotations

import datetime

from .._version import __version__
from ..artifact import ModelFiles
from . import data
from .fold import Folded
from .recipe import CalibrationRecipe
from .smoothing import ALPHA_GRID


def build_manifest(
    source: ModelFiles, recipe: CalibrationRecipe, samples: list[list[int]], folded: Folded, quantized_layers: list[str]
) -> dict:
    """Everything but ``format_version`` and ``files``, which ``ArtifactWriter.finish`` adds once every file exists."""
    return {
        "quasar_deploy_version": __version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "source": {"path": str(source.path), "architecture": source.spec.architecture, "sha256": source.checkpoint.fingerprint()},
        "recipe": {
            "scheme": recipe.scheme.to_dict(),
            "alpha": recipe.alpha,
            "alpha_grid": list(ALPHA_GRID) if recipe.alpha == "auto" else None,
            "num_samples": recipe.num_samples,
            "seq_len": recipe.seq_len,
            "keep_float": list(recipe.keep_float),
            "keep_float_above": recipe.keep_float_above,
            "int8_lm_head": recipe.int8_lm_head,
        },
        "calibration": {
            "data": recipe.calib_data or "built-in",
            "samples": len(samples),
            "tokens": sum(len(s) for s in samples),
            "fingerprint": data.fingerprint(samples),
        },
        "groups": [
            {
                "name": group.name,
                "source": group.source,
                "linears": list(group.linears),
                "alpha": result.alpha,
                "error_before": result.error_before,
                "error_after": result.error_after,
            }
            for group, result in folded.groups
        ],
        "layers": {
            name: {"quantized": layer.quantized, "error": layer.error, "float_reason": layer.float_reason}
            for name, layer in folded.layers.items()
        },
        "quantized_layers": quantized_layers,
    }
