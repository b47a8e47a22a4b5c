"""The interface every backend serves, and the registry that picks one.

A backend owns one sequence's KV cache. The speculative loop only ever prefills,
appends a block of tokens (one for plain decoding, k+1 to verify a draft) and
rolls the cache back after a rejection.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import torch

from ..errors import QuasarError


@runtime_checkable
class CausalLM(Protocol):
    vocab_size: int
    max_length: int

    def prefill(self, ids: Sequence[int]) -> torch.Tensor:
        """Start a new sequence: cache ``ids`` and return the logits [vocab] of the last position."""

    def verify(self, ids: Sequence[int]) -> torch.Tensor:
        """Append ``ids`` to the cache and return their logits [len(ids), vocab] (float32)."""

    def truncate(self, length: int) -> None:
        """Roll the cache back to its first ``length`` positions."""

    @property
    def length(self) -> int:
        """Positions currently cached."""


Factory = Callable[..., CausalLM]
BACKENDS: dict[str, tuple[Factory, Callable[[], str | None]]] = {}


def register(name: str, factory: Factory, unavailable: Callable[[], str | None]) -> None:
    """``unavailable()`` returns None when the backend can run here, else the reason in one line."""
    BACKENDS[name] = (factory, unavailable)


def available_backends() -> dict[str, str | None]:
    """Every registered backend and why it cannot run here (None: it can)."""
    return {name: unavailable() for name, (_, unavailable) in BACKENDS.items()}


def create_backend(name: str, path, **options) -> CausalLM:
    if name == "auto":
        name = next(n for n in ("cuda", "cpu") if n in BACKENDS and BACKENDS[n][1]() is None)
    if name not in BACKENDS:
        raise QuasarError(f"unknown backend {name!r}; choose from auto, {', '.join(BACKENDS)}")
    factory, unavailable = BACKENDS[name]
    reason = unavailable()
    if reason is not None:
        raise QuasarError(f"backend {name!r} cannot run here: {reason}")
    return factory(path, **options)
