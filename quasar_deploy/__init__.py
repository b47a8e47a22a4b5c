"""quasar-deploy: speculative decoding verified by a W8A8 copy of the model.

    artifact = quasar_deploy.calibrate("Qwen3-8B", output="qwen3-8b-w8a8")
    fidelity = quasar_deploy.evaluate("qwen3-8b-w8a8", reference="Qwen3-8B")
    engine = quasar_deploy.load("qwen3-8b-w8a8")
    print(engine.generate("def quicksort(xs):", max_new_tokens=64).text)

The API names load on first use, so ``import quasar_deploy`` (and the CLI's ``--help``) does not pay for torch."""

from __future__ import annotations

import importlib
from typing import Any

from ._version import __version__
from .errors import QuasarError

_API = {
    "calibrate": "quasar_deploy.calibration",
    "CalibrationRecipe": "quasar_deploy.calibration",
    "demo_model_path": "quasar_deploy.demo",
    "load": "quasar_deploy.api",
    "Engine": "quasar_deploy.engine",
    "GenerationResult": "quasar_deploy.engine",
    "evaluate": "quasar_deploy.fidelity",
    "export": "quasar_deploy.exporters",
    "ModelFiles": "quasar_deploy.artifact",
    "open_model_files": "quasar_deploy.artifact",
}


def __getattr__(name: str) -> Any:
    if name not in _API:
        raise AttributeError(f"module 'quasar_deploy' has no attribute {name!r}")
    value = getattr(importlib.import_module(_API[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_API])


__all__ = ["QuasarError", "__version__", *_API]
