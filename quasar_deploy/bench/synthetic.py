"""Random-weight decoders of published shapes, for timing only (their outputs mean nothing).

Weights stream from memory at these sizes, which is where int8 pays: a timing on
the tiny demo model (all in cache) would understate it. Reports that use these
say "synthetic weights".
"""

from __future__ import annotations

import torch

from ..decoder_spec import DecoderSpec, expected_shapes
from ..errors import QuasarError
from ..model import Decoder
from ..scheme import quantize_weight

SHAPES = {
    # name: hidden, intermediate, layers, heads, kv heads, head_dim, vocab, tied embeddings (published configs)
    "qwen3-0.6b": (1024, 3072, 28, 16, 8, 128, 151936, True),
    "qwen3-1.7b": (2048, 6144, 28, 16, 8, 128, 151936, True),
    "qwen3-4b": (2560, 9728, 36, 32, 8, 128, 151936, True),
    "qwen3-8b": (4096, 12288, 36, 32, 8, 128, 151936, False),
    "llama-3.2-1b": (2048, 8192, 16, 32, 8, 64, 128256, True),
    "llama-3-8b": (4096, 14336, 32, 32, 8, 128, 128256, False),
    # "-like": openPangu-Embedded-7B's model card publishes 34 layers, 32 query / 8 KV heads, a "153k" vocabulary and
    # 12800 (the intermediate size); hidden 4096, head_dim 128, vocab 153376 and untied embeddings are our assumptions
    "openpangu-7b-like": (4096, 12800, 34, 32, 8, 128, 153376, False),
}


def synthetic_spec(name: str) -> DecoderSpec:
    if name not in SHAPES:
        raise QuasarError(f"unknown synthetic shape {name!r}; choose from {', '.join(SHAPES)}")
    hidden, inner, layers, heads, kv, head_dim, vocab, tied = SHAPES[name]
    return DecoderSpec(
        architecture=f"synthetic {name}",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inner,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv,
        head_dim=head_dim,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        rope_scaling=None,
        max_position_embeddings=4096,
        tie_word_embeddings=tied,
        qk_norm=name.startswith("qwen3"),
        sliding_window=None,
    )


class RandomTensors:
    """A ``TensorSource`` that invents each tensor on request: normal(0, 0.02) weights, unit norms."""

    def __init__(self, spec: DecoderSpec, seed: int = 0):
        self.spec = spec
        self.generator = torch.Generator().manual_seed(seed)
        self.shapes = {name: shape for name, shape in expected_shapes(spec).items() if name.endswith(".weight")}
        self.names = set(self.shapes)

    def tensor(self, name: str) -> torch.Tensor:
        shape = self.shapes[name]
        if len(shape) == 1:
            return torch.ones(shape)
        return torch.randn(shape, generator=self.generator) * 0.02


def synthetic_decoders(name: str, seed: int = 0) -> tuple[Decoder, Decoder]:
    """(float, W8A8) decoders with identical random weights; W8A8 is quantized without smoothing (timing only)."""
    spec = synthetic_spec(name)
    return Decoder(spec, RandomTensors(spec, seed)), synthetic_w8a8_decoder(name, seed)


def synthetic_w8a8_decoder(name: str, seed: int = 0) -> Decoder:
    """The W8A8 decoder of ``synthetic_decoders`` alone (no float copy held meanwhile)."""
    spec = synthetic_spec(name)
    quant_model = Decoder(spec, RandomTensors(spec, seed))
    with torch.no_grad():
        for _, linear in quant_model.linears():
            wq, scale = quantize_weight(linear.weight.data)
            linear.set_quantized(wq, scale, None)
    return quant_model
