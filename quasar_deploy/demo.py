"""The demo model shipped inside the package (trained by tools/train_demo_model.py)."""

from __future__ import annotations

from pathlib import Path


def demo_model_path() -> Path:
    """Directory of the shipped demo model: a normal Hugging Face checkpoint (Qwen3, ~5.8M parameters)."""
    return Path(__file__).resolve().parent / "demo_model"
