"""Building what the benchmark compares: float and W8A8 engines, and Hugging Face's own float model."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from ..api import load
from ..artifact import open_model_files
from ..backends.onnx_export_cache import head_outside
from ..backends.registry import unavailable
from ..backends.torch_backend import TorchCausalLM
from ..cpu.choice import default_int8_kernel
from ..cpu.linears import default_float_dtype, default_float_kernel
from ..decoder_spec import DecoderSpec
from ..demo import demo_model_path
from ..engine import Engine, stop_ids_of
from ..errors import QuasarError
from ..exact_mode import ExactEngine
from ..exporters import export
from ..tokenizer import load_tokenizer
from .memory import check_fits
from .synthetic import RandomTensors, engines_peak_bytes, synthetic_decoders, synthetic_spec


@dataclass
class Contenders:
    """What the modes run on: float and W8A8 engines, built on first use, and Hugging Face's float model (``load_hf``)."""

    build_engines: Callable[[], tuple[Engine, Engine]]
    tokenizer: Any
    stop_ids: frozenset[int]
    load_hf: Callable[[], Any] | None
    weights: str  # "trained" or "synthetic weights"
    pruned_layers: frozenset[int] = field(default_factory=frozenset)
    ort_engines: dict[str, object] = field(default_factory=dict)  # "float" / "w8a8": engines on exported ONNX graphs
    _exact: dict[str, ExactEngine] = field(default_factory=dict, repr=False)

    @cached_property
    def _engines(self) -> tuple[Engine, Engine]:
        return self.build_engines()

    @property
    def float_engine(self) -> Engine:
        return self._engines[0]

    @property
    def w8a8_engine(self) -> Engine:
        return self._engines[1]

    def exact_engine(self, pair: str = "cpu") -> ExactEngine:
        """Exact mode over the float and W8A8 engines' own models, no third copy (``pair``: a ``modes.EXACT_MODES`` value)."""
        if pair not in self._exact:
            verifier = self.ort_engines["float"] if pair == "ort" else self.float_engine
            middle = self.w8a8_engine if pair == "cpu" else self.ort_engines["w8a8"]
            self._exact[pair] = ExactEngine(verifier.lm, verifier.tokenizer, verifier.stop_ids, verifier.backend, middle=middle.lm)
        return self._exact[pair]


def _hf_model_from(path: Path):
    from transformers import AutoModelForCausalLM  # heavy: transformers, for HF contenders only

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def ort_engines(model: str | Path, artifact: str | Path, workdir: Path) -> dict[str, Engine]:
    """Both models exported to ONNX under ``workdir`` and served by the onnxruntime backend ({} without onnxruntime)."""
    if unavailable("onnxruntime") is not None:
        return {}
    float_dir = export(model, "onnx", workdir / "float-onnx", precision="float")
    # as auto exports it here: on a bf16 CPU, without the float head (run in bf16 beside the graph)
    w8a8_dir = export(artifact, "onnx", workdir / "w8a8-onnx", precision="w8a8", head_outside=head_outside(Path(artifact)))
    return {"float": load(float_dir, backend="onnxruntime"), "w8a8": load(w8a8_dir, backend="onnxruntime")}


def trained_contenders(model: str | Path, artifact: str | Path, with_hf: bool = True, ort_workdir: Path | None = None) -> Contenders:
    """A float checkpoint and its W8A8 artifact on the cpu backend (fastest bit-exact kernels); on ONNX Runtime too with ``ort_workdir``."""
    if not open_model_files(artifact).is_artifact:
        raise QuasarError(f"{artifact}: not a W8A8 artifact (no quasar.json)")
    files = open_model_files(model)
    if files.is_artifact:
        raise QuasarError(f"{model}: expected the float checkpoint, got an artifact")
    ort = ort_engines(model, artifact, ort_workdir) if ort_workdir else {}
    return Contenders(
        lambda: (load(model, backend="cpu"), load(artifact, backend="cpu")),
        load_tokenizer(files),
        stop_ids_of(files.path, files.listed),
        (lambda: _hf_model_from(Path(model))) if with_hf else None,
        "trained",
        ort_engines=ort,
    )


def _hf_twin(spec: DecoderSpec, tensors: Mapping[str, torch.Tensor]):
    """Hugging Face's Qwen3 holding ``tensors`` (by HF name, shared, not copied), for hf-prompt-lookup."""
    from transformers import Qwen3Config, Qwen3ForCausalLM  # heavy: transformers, for HF contenders only
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding  # heavy: transformers, for HF contenders only

    config = Qwen3Config(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        head_dim=spec.head_dim,
        rms_norm_eps=spec.rms_norm_eps,
        rope_theta=spec.rope_theta,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
    )
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    model.load_state_dict(dict(tensors), assign=True, strict=False)
    model.model.rotary_emb = Qwen3RotaryEmbedding(config)  # its buffer was created on the meta device
    model.tie_weights()
    return model.eval()


def synthetic_contenders(shape: str, with_hf: bool = True) -> Contenders:
    """Random weights of a published shape (timing only), the demo tokenizer for prompts; refused up front when they cannot fit."""
    spec = synthetic_spec(shape)
    check_fits(engines_peak_bytes(spec), f"bench e2e --synthetic {shape}")
    tokenizer = load_tokenizer(open_model_files(demo_model_path()))

    def build_engines() -> tuple[Engine, Engine]:
        decoders = synthetic_decoders(shape, kernels=(default_float_kernel(), default_int8_kernel()), dtype=default_float_dtype("cpu"))
        return tuple(Engine(TorchCausalLM(d), tokenizer, frozenset(), "cpu") for d in decoders)

    def load_hf():
        source = RandomTensors(spec)  # the same values the engines draw, in the engines' float32
        return _hf_twin(spec, {name: source.tensor(name).float() for name in source.names})

    return Contenders(
        build_engines, tokenizer, frozenset(), load_hf if with_hf and shape.startswith("qwen3") else None, "synthetic weights"
    )
