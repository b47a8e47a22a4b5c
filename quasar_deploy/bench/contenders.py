"""Building what the benchmark compares: float and W8A8 engines, and Hugging Face's own float model."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..artifact import open_model_files
from ..backends.torch_backend import TorchCausalLM
from ..demo import demo_model_path
from ..engine import Engine, load
from ..errors import QuasarError
from ..kernels import default_float_kernel, default_int8_kernel
from ..tokenizer import load_tokenizer
from .synthetic import synthetic_decoders


@dataclass
class Contenders:
    """What the modes run on: two engines (float and W8A8 verifier) and, when available, the HF float model."""

    float_engine: object
    w8a8_engine: object
    hf_model: object | None
    weights: str  # "trained" or "synthetic weights"
    pruned_layers: frozenset[int] = field(default_factory=frozenset)
    ort_engines: dict[str, object] = field(default_factory=dict)  # "float" / "w8a8": engines on exported ONNX graphs


def _hf_model_from(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def ort_engines(model: str | Path, artifact: str | Path, workdir: Path) -> dict[str, Engine]:
    """Both models exported to ONNX under ``workdir`` and served by the onnxruntime backend ({} without onnxruntime)."""
    from ..backends.registry import unavailable
    from ..exporters import export

    if unavailable("onnxruntime") is not None:
        return {}
    float_dir = export(model, "onnx", workdir / "float-onnx", precision="float")
    w8a8_dir = export(artifact, "onnx", workdir / "w8a8-onnx", precision="w8a8")
    return {"float": load(float_dir, backend="onnxruntime"), "w8a8": load(w8a8_dir, backend="onnxruntime")}


def trained_contenders(model: str | Path, artifact: str | Path, with_hf: bool = True, ort_workdir: Path | None = None) -> Contenders:
    """A float checkpoint and its W8A8 artifact on the cpu backend (fastest exact kernels); on ONNX Runtime too with ``ort_workdir``."""
    if not open_model_files(artifact).is_artifact:
        raise QuasarError(f"{artifact}: not a W8A8 artifact (no quasar.json)")
    if open_model_files(model).is_artifact:
        raise QuasarError(f"{model}: expected the float checkpoint, got an artifact")
    float_engine, w8a8_engine = load(model, backend="cpu"), load(artifact, backend="cpu")
    ort = ort_engines(model, artifact, ort_workdir) if ort_workdir else {}
    return Contenders(float_engine, w8a8_engine, _hf_model_from(Path(model)) if with_hf else None, "trained", ort_engines=ort)


def _hf_twin(decoder):
    """Hugging Face's Qwen3 with the very same (shared, not copied) random weights, for hf-prompt-lookup."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    s = decoder.spec
    config = Qwen3Config(
        vocab_size=s.vocab_size,
        hidden_size=s.hidden_size,
        intermediate_size=s.intermediate_size,
        num_hidden_layers=s.num_layers,
        num_attention_heads=s.num_heads,
        num_key_value_heads=s.num_kv_heads,
        head_dim=s.head_dim,
        rms_norm_eps=s.rms_norm_eps,
        rope_theta=s.rope_theta,
        max_position_embeddings=s.max_position_embeddings,
        tie_word_embeddings=s.tie_word_embeddings,
    )
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    model.load_state_dict(decoder.state_dict(), assign=True, strict=False)
    model.model.rotary_emb = Qwen3RotaryEmbedding(config)  # its buffer was created on the meta device
    model.tie_weights()
    return model.eval()


def synthetic_contenders(shape: str, with_hf: bool = True) -> Contenders:
    """Random weights of a published shape (timing only), the demo tokenizer for prompts."""
    float_model, quant_model = synthetic_decoders(shape)
    hf = _hf_twin(float_model) if with_hf and shape.startswith("qwen3") else None  # before packing releases our copies
    for decoder in (float_model, quant_model):
        decoder.prepare(default_float_kernel(), default_int8_kernel(), fuse=True)
    tokenizer = load_tokenizer(demo_model_path())
    engines = [Engine(TorchCausalLM(d), tokenizer, frozenset(), "cpu") for d in (float_model, quant_model)]
    return Contenders(engines[0], engines[1], hf, "synthetic weights")
