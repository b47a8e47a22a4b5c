"""``load``: a model directory in, an engine out, the verify mode dispatched here (above the engine and exact mode's
engine, which builds on it)."""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import Any

from .engine import VERIFY_MODES, Engine, open_engine, warm_up
from .errors import QuasarError
from .exact_mode import load_exact


def load(
    path: str | Path,
    backend: str = "auto",
    trust_remote_code: bool = False,
    needs: Collection[str] = (),
    verify: str = "model",
    exact_source: str | Path | None = None,
    **backend_options: Any,
) -> Engine:
    """An engine for a W8A8 artifact (W8A8 verifier), a plain Hugging Face checkpoint (float verifier) or an export at ``path``.

    ``backend="auto"``: the fastest backend here that provides ``needs``; ``verify="exact"``: ``exact_mode.load_exact``."""
    if verify not in VERIFY_MODES:
        raise QuasarError(f"unknown verify mode {verify!r}; choose from {', '.join(VERIFY_MODES)}")
    if verify == "exact":
        return load_exact(path, exact_source, backend, trust_remote_code, needs, **backend_options)
    if exact_source is not None:
        raise QuasarError("exact_source applies to verify='exact'")
    engine = open_engine(path, backend, needs, trust_remote_code, **backend_options)
    warm_up(engine.lm)
    return engine
