"""Published decoder shapes by name: what ``inflate`` grows the demo model to, and what the benchmarks time with random weights."""

from __future__ import annotations

from typing import NamedTuple


class Shape(NamedTuple):
    """The dimensions of a published config (``tied``: lm_head shares the embedding table)."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool


SHAPES = {
    "qwen3-0.6b": Shape(1024, 3072, 28, 16, 8, 128, 151936, True),
    "qwen3-1.7b": Shape(2048, 6144, 28, 16, 8, 128, 151936, True),
    "qwen3-4b": Shape(2560, 9728, 36, 32, 8, 128, 151936, True),
    "qwen3-8b": Shape(4096, 12288, 36, 32, 8, 128, 151936, False),
    "llama-3.2-1b": Shape(2048, 8192, 16, 32, 8, 64, 128256, True),
    "llama-3-8b": Shape(4096, 14336, 32, 32, 8, 128, 128256, False),
    # "-like": openPangu-Embedded-7B's card gives layers, heads, ~153k vocab, 12800; hidden, head_dim, vocab, untied: assumed
    "openpangu-7b-like": Shape(4096, 12800, 34, 32, 8, 128, 153376, False),
}
