"""The demo model shipped inside the package (trained by tools/train_demo_model.py), and its outlier variant."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..calibration import CalibrationRecipe

VARIANTS = ("plain", "outlier")


def cache_dir() -> Path:
    """Where quasar-deploy keeps what it derives (outlier variants, demo artifacts): $QUASAR_CACHE or ~/.cache/quasar-deploy."""
    root = os.environ.get("QUASAR_CACHE") or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "quasar-deploy"
    return Path(root)


def demo_model_path(variant: str = "plain") -> Path:
    """Directory of the shipped demo model (a Hugging Face Qwen3 checkpoint, ~5.8M parameters).

    ``variant="outlier"``: the same function with planted activation outliers
    (``quasar_deploy.outliers``), built on first use in the cache, never shipped.
    """
    plain = Path(__file__).resolve().parent.parent / "demo_model"
    if variant == "plain":
        return plain
    if variant != "outlier":
        raise ValueError(f"unknown demo model variant {variant!r}; choose from {VARIANTS}")
    from ..outliers import write_outlier_variant

    tag = hashlib.sha256((plain / "model.safetensors").read_bytes()).hexdigest()[:12]
    path = cache_dir() / f"demo-outlier-{tag}"
    if not (path / "config.json").exists():
        write_outlier_variant(plain, path)
    return path


def demo_recipe() -> CalibrationRecipe:
    """Built on call, not at import: the recipe's package loads torch, and ``demo_model_path`` must not."""
    from ..calibration import CalibrationRecipe

    return CalibrationRecipe(num_samples=24, seq_len=256, alpha="auto", activation="dynamic")


def demo_artifact(progress: bool = True) -> Path:
    """The demo model's W8A8 artifact, calibrated once and cached; recalibrated when the model, recipe or artifact format changes."""
    import json

    from .._version import __version__
    from ..artifact import FORMAT_VERSION
    from ..calibration import calibrate

    plain = demo_model_path()
    recipe = demo_recipe()
    inputs = json.dumps([recipe.to_dict(), __version__, FORMAT_VERSION]).encode()
    key = hashlib.sha256((plain / "model.safetensors").read_bytes() + inputs).hexdigest()[:12]
    path = cache_dir() / f"demo-w8a8-{key}"
    if not (path / "quasar.json").exists():
        calibrate(plain, output=path, recipe=recipe, progress=progress)
    return path
