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


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    """Tiny models run fastest on one thread, and a busy 2-core machine punishes OpenMP spinning."""
    import torch

    torch.set_num_threads(1)
