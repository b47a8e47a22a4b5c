"""The backends users can pick, by name, and the factory that builds one.

Each entry names its factory and its availability check as ``"module:callable"``,
imported on first use: reading the names (the CLI's ``--backend`` choices) loads no
torch, and a backend whose runtime is missing (torch_npu, onnxruntime) is never imported
until someone asks for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import QuasarError
from ..integrity import export_target
from ..lazy import resolve

if TYPE_CHECKING:
    from ..speculative.causal_lm import CausalLM


@dataclass(frozen=True)
class BackendEntry:
    """``factory(path, **options)`` builds the ``CausalLM``; ``unavailable()`` is None where it can run, else why not."""

    factory: str
    unavailable: str


BACKENDS: dict[str, BackendEntry] = {
    "cuda": BackendEntry("quasar_deploy.backends.cuda:load_cuda", "quasar_deploy.backends.cuda:unavailable"),
    "cpu": BackendEntry("quasar_deploy.backends.torch_backend:load_cpu", "quasar_deploy.backends.torch_backend:unavailable"),
    "npu": BackendEntry("quasar_deploy.backends.npu:load_npu", "quasar_deploy.backends.npu:unavailable"),
    "onnxruntime": BackendEntry("quasar_deploy.backends.onnxruntime:load_onnx", "quasar_deploy.backends.onnxruntime:unavailable"),
}

# "auto" takes the first of these that can run here for artifacts and checkpoints. ONNX Runtime runs exports only: it was
# not measured faster than the torch cpu backend across loads (docs/architecture.md, "Choosing the backend").
AUTO_ORDER = ("cuda", "cpu")
# export target (``quasar-export.json``) -> the backend that runs it; targets missing here are other runtimes' to serve
EXPORT_BACKENDS = {"onnx": "onnxruntime"}
# files that mark an export whose manifest is missing (a partial copy): routed as their target, whose loader then explains
EXPORT_MARKERS = {"genai_config.json": "onnx", "quant_model_description.json": "npu"}


def unavailable(name: str) -> str | None:
    """Why backend ``name`` cannot run here, in one line (None: it can)."""
    return resolve(BACKENDS[name].unavailable)()


def available_backends() -> dict[str, str | None]:
    """Every registered backend and why it cannot run here (None: it can)."""
    return {name: unavailable(name) for name in BACKENDS}


def default_backend() -> str:
    """The backend "auto" gives artifacts and float checkpoints here: the first of ``AUTO_ORDER`` that can run."""
    return next(n for n in AUTO_ORDER if n in BACKENDS and unavailable(n) is None)


def auto_backend(path: Any) -> str:
    """The backend for what ``path`` holds: an export runs on the backend of the target its ``quasar-export.json`` records
    (ONNX: onnxruntime); artifacts and checkpoints on ``default_backend()``. An NPU export is vLLM-Ascend's to serve."""
    directory = Path(path)
    target = export_target(directory) or next((t for marker, t in EXPORT_MARKERS.items() if (directory / marker).is_file()), None)
    if target is None:
        return default_backend()
    if target == "npu":
        raise QuasarError(
            f"{directory}: an NPU export (msModelSlim layout) is served by vLLM-Ascend (docs/npu.md); "
            "to run on an NPU with quasar-deploy, load the artifact it came from with backend 'npu'"
        )
    if target not in EXPORT_BACKENDS:
        raise QuasarError(f"{directory}: a {target!r} export, which no backend of this quasar-deploy runs")
    return EXPORT_BACKENDS[target]


def create_backend(name: str, path: Any, **options: Any) -> CausalLM:
    """The model at ``path`` on backend ``name`` ("auto": chosen by ``auto_backend``)."""
    if name == "auto":
        name = auto_backend(path)
    if name not in BACKENDS:
        raise QuasarError(f"unknown backend {name!r}; choose from auto, {', '.join(BACKENDS)}")
    reason = unavailable(name)
    if reason is not None:
        raise QuasarError(f"backend {name!r} cannot run here: {reason}")
    return resolve(BACKENDS[name].factory)(path, **options)
