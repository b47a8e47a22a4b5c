"""The demo model shipped inside the package (trained by tools/train_demo_model.py), and its outlier variant."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

from .._version import __version__
from ..cache import cache_dir, used

if TYPE_CHECKING:
    from ..calibration import CalibrationRecipe
    from ..inflate import InflationTarget

VARIANTS = ("plain", "outlier")
INFLATED_SHAPE = "qwen3-0.6b"  # the published body the demo model is inflated to (shapes.SHAPES)
INFLATION_SEED = 0
DEFAULT_LIMIT, DEFAULT_MAX_NEW_TOKENS = 4, 64  # built-in prompts measured, new tokens per prompt (``quasar-deploy demo``'s)


def demo_model_path(variant: str = "plain") -> Path:
    """Directory of the shipped demo model; ``variant="outlier"``: the same function with planted activation outliers
    (``quasar_deploy.outliers``), built on first use in the cache."""
    plain = Path(__file__).resolve().parent.parent / "demo_model"
    if variant == "plain":
        return plain
    if variant != "outlier":
        raise ValueError(f"unknown demo model variant {variant!r}; choose from {VARIANTS}")
    from ..outliers import write_outlier_variant  # keeps --help torch-free

    tag = hashlib.sha256((plain / "model.safetensors").read_bytes()).hexdigest()[:12]
    path = cache_dir() / f"demo-outlier-{tag}"
    if not (path / "config.json").exists():
        write_outlier_variant(plain, path)
    return path


def demo_recipe() -> CalibrationRecipe:
    """Built on call, not at import: the recipe's package loads torch, and ``demo_model_path`` must not."""
    from ..calibration import CalibrationRecipe  # keeps --help torch-free

    return CalibrationRecipe(num_samples=24, seq_len=256, alpha="auto", activation="dynamic")


def _key(*inputs: object) -> str:
    """12 hex digits naming a cached derivation: the demo model's bytes and everything else that shapes the result."""
    plain = demo_model_path() / "model.safetensors"
    return hashlib.sha256(plain.read_bytes() + json.dumps(inputs).encode()).hexdigest()[:12]


def demo_artifact_path() -> Path:
    """Where the demo artifact is cached: keyed by the model, recipe, quasar-deploy version and artifact format."""
    from ..artifact import FORMAT_VERSION  # keeps --help torch-free

    return cache_dir() / f"demo-w8a8-{_key(demo_recipe().to_dict(), __version__, FORMAT_VERSION)}"


def demo_artifact(progress: bool = True) -> Path:
    """The demo model's W8A8 artifact, calibrated once and cached; recalibrated when the model, recipe or artifact format changes."""
    from ..calibration import calibrate  # keeps --help torch-free

    path = demo_artifact_path()
    if not (path / "quasar.json").exists():
        calibrate(demo_model_path(), output=path, recipe=demo_recipe(), progress=progress)
    used(path)  # the cache evicts what was used least recently
    return path


def inflation_target() -> InflationTarget:
    """Qwen3-0.6B's body with the demo model's head_dim 64: its widths (32 query / 16 KV heads of 64 = its 16 / 8 of 128)."""
    from ..artifact import open_model_files  # keeps --help torch-free
    from ..inflate import body_of  # keeps --help torch-free

    return body_of(INFLATED_SHAPE, open_model_files(demo_model_path()).spec)


def inflated_demo_paths() -> tuple[Path, Path]:
    """(float checkpoint, W8A8 artifact) of the inflated demo model in the cache, keyed like the demo artifact they come from."""
    key = _key(demo_artifact_path().name, inflation_target().to_dict(), INFLATION_SEED, __version__)
    return cache_dir() / f"demo-inflated-float-{key}", cache_dir() / f"demo-inflated-w8a8-{key}"


def inflated_demo(progress: bool = True) -> tuple[Path, Path]:
    """The demo model and its artifact inflated function-preservingly to the Qwen3-0.6B body (``inflate.py``), written once."""
    from ..inflate import inflate_artifact, inflate_checkpoint  # keeps --help torch-free

    model, artifact = inflated_demo_paths()
    target = inflation_target()
    if not (model / "config.json").exists():
        inflate_checkpoint(demo_model_path(), model, target, INFLATION_SEED, progress)
    if not (artifact / "quasar.json").exists():
        inflate_artifact(demo_artifact(progress), artifact, target, model, INFLATION_SEED, progress)
    used(model)
    used(artifact)
    return model, artifact
