"""Backends: each serves the same small ``CausalLM`` interface to the speculative loop."""

from . import npu, onnxruntime, torch_backend  # noqa: F401  (register "npu", "onnxruntime" and "cpu")
from .base import BACKENDS, CausalLM, available_backends, create_backend

__all__ = ["BACKENDS", "CausalLM", "available_backends", "create_backend"]
