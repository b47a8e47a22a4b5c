"""Backends: each serves the speculative loop's ``CausalLM`` protocol; the registry picks one by name.

Importing this package loads no backend module (and no torch): the registry imports each on first use.
"""

from .registry import BACKENDS, available_backends, create_backend, resolve_backend

__all__ = ["BACKENDS", "available_backends", "create_backend", "resolve_backend"]
