"""``"module:attribute"`` references resolved on first use: how a registry names code without importing it."""

from __future__ import annotations

import importlib
from typing import Any


def resolve(reference: str) -> Any:
    """The object ``reference`` ("package.module:attribute") names, importing its module now."""
    module, _, attribute = reference.partition(":")
    return getattr(importlib.import_module(module), attribute)
