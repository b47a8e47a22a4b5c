"""``load``: a model directory in, an engine out, the verify mode dispatched here (above the engine and exact mode's
engine, which builds on it)."""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path
from typing import Any

from .backends import create_backend, resolve_backend
from .engine import VERIFY_MODES, Engine, stop_ids_of, warm_up
from .errors import QuasarError
from .exact_mode import load_exact
from .tokenizer import load_tokenizer


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
    backend = resolve_backend(backend, path, needs, backend_options)
    lm = create_backend(backend, path, needs, **backend_options)
    engine = Engine(lm, load_tokenizer(path, trust_remote_code), stop_ids_of(path), backend)
    warm_up(lm)
    return engine
