"""``"module:attribute"`` references resolved on first use: how a registry names code without importing it.

A table of names that the CLI reads for its ``--help`` choices must not pull in torch,
so the registries hold these strings and import the module only when an entry is used.
"""

from __future__ import annotations

import importlib
from typing import Any


def resolve(reference: str) -> Any:
    """The object ``reference`` ("package.module:attribute") names, importing its module now."""
    module, _, attribute = reference.partition(":")
    return getattr(importlib.import_module(module), attribute)
