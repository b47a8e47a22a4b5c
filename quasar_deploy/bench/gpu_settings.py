"""What ``bench gpu`` measures, checked before any GPU work; torch-free, so the CLI's defaults come from here without loading torch."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import QuasarError

DEFAULT_SHAPES = ("qwen3-1.7b", "qwen3-8b")
DEFAULT_ROWS = (1, 6, 16, 32)


@dataclass(frozen=True)
class GpuSettings:
    shapes: tuple[str, ...] = DEFAULT_SHAPES
    tokens: int = 6
    context: int = 512
    repeats: int = 30
    rows: tuple[int, ...] = DEFAULT_ROWS
    e2e_shape: str = "qwen3-1.7b"
    prompts: int = 5
    max_new_tokens: int = 128
    num_draft: int = 5
    quantizer: str = "triton"

    def __post_init__(self) -> None:
        from .synthetic import SHAPES  # keeps --help torch-free

        for shape in (*self.shapes, self.e2e_shape):
            if shape not in SHAPES:
                raise QuasarError(f"unknown synthetic shape {shape!r}; choose from {', '.join(SHAPES)}")
        for name in ("tokens", "context", "repeats", "prompts", "max_new_tokens", "num_draft"):
            if getattr(self, name) < 1:
                raise QuasarError(f"{name.replace('_', '-')} must be at least 1, not {getattr(self, name)}")
        if not self.rows or min(self.rows) < 1:
            raise QuasarError("rows must be positive integers")
        if self.tokens > 16:
            raise QuasarError("tokens per verify step must be at most 16 (the cuda backend graphs blocks up to 16 tokens)")
