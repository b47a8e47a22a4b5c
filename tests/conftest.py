"""Shared fixtures: tiny random models, built once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from .tiny import save_tiny


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("tiny-qwen3"), "qwen3")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("tiny-llama"), "llama", seed=1)
