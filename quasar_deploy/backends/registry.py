"""The backends users can pick, by name, and the factory that builds one.

Each entry names its factory and its availability check as ``"module:callable"``,
imported on first use: reading the names (the CLI's ``--backend`` choices) loads no
torch, and a backend whose runtime is missing (torch_npu, onnxruntime) is never imported
until someone asks for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import QuasarError
from ..lazy import resolve

if TYPE_CHECKING:
    from ..speculative.causal_lm import CausalLM


@dataclass(frozen=True)
class BackendEntry:
    """``factory(path, **options)`` builds the ``CausalLM``; ``unavailable()`` is None where it can run, else why not."""

    factory: str
    unavailable: str


BACKENDS: dict[str, BackendEntry] = {
    "cpu": BackendEntry("quasar_deploy.backends.torch_backend:load_cpu", "quasar_deploy.backends.torch_backend:unavailable"),
    "npu": BackendEntry("quasar_deploy.backends.npu:load_npu", "quasar_deploy.backends.npu:unavailable"),
    "onnxruntime": BackendEntry("quasar_deploy.backends.onnxruntime:load_onnx", "quasar_deploy.backends.onnxruntime:unavailable"),
}

# "auto" takes the first of these that can run here.
AUTO_ORDER = ("cuda", "cpu")


def unavailable(name: str) -> str | None:
    """Why backend ``name`` cannot run here, in one line (None: it can)."""
    return resolve(BACKENDS[name].unavailable)()


def available_backends() -> dict[str, str | None]:
    """Every registered backend and why it cannot run here (None: it can)."""
    return {name: unavailable(name) for name in BACKENDS}


def create_backend(name: str, path: Any, **options: Any) -> CausalLM:
    """The model at ``path`` on backend ``name`` ("auto": the first of ``AUTO_ORDER`` that runs here)."""
    if name == "auto":
        name = next(n for n in AUTO_ORDER if n in BACKENDS and unavailable(n) is None)
    if name not in BACKENDS:
        raise QuasarError(f"unknown backend {name!r}; choose from auto, {', '.join(BACKENDS)}")
    reason = unavailable(name)
    if reason is not None:
        raise QuasarError(f"backend {name!r} cannot run here: {reason}")
    return resolve(BACKENDS[name].factory)(path, **options)
