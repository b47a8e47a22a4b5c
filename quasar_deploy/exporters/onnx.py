"""``export --target onnx``: the decoder graph, its weights, and a ``genai_config.json`` sidecar."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from tqdm import tqdm

from ..errors import QuasarError
from . import ONNX_HEAD_FILE as HEAD_FILE

try:
    import onnx
except ImportError:
    raise QuasarError("the onnx target needs the onnx package: pip install 'quasar-deploy[onnx]'") from None

from ..artifact import HEAD, MANIFEST, ModelFiles, checked_row_blocks
from ..decoder_spec import DecoderSpec, rope_inv_freq
from ..files import TOKENIZER_FILES, atomic_directory, copy_files, sha256_files
from ..integrity import write_export_manifest
from ..memory import EMBEDDINGS, graph_bytes
from ..model import BlockSource, DecoderLayer, Linear, RMSNorm, load_linear, tensor_loader
from .onnx_graph import BFLOAT16, FLOAT32, HEAD_OUTSIDE, HIDDEN, LINEAR_FORMATS, ExternalData, Fill, GraphBuilder, build_graph
from .onnx_versions import IR_VERSIONS, OPSETS

MODEL_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"
CONFIG_FILE = "genai_config.json"
SIDECAR_FORMAT = 1
# weights above this go to ``model.onnx.data`` as the graph is built (held whole and copied by ORT otherwise)
EXTERNAL_DATA_THRESHOLD = 64 * 2**20
LINEAR_DESCRIPTIONS = {
    "integer": "u8xs8 MatMulInteger, integer-exact int32 accumulation",
    "qdq": "int8 QuantizeLinear/DequantizeLinear around MatMul: static per-tensor activations, per-channel weights",
}


def genai_config(files: ModelFiles, precision: str, linear_format: str | None, head_outside: bool = False) -> dict:
    """onnxruntime-genai's ``genai_config.json`` layout, plus a ``quasar`` block saying what the graph computes."""
    spec, config, scheme = files.spec, files.checkpoint.config, files.scheme
    inputs = {name: name for name in ("input_ids", "attention_mask", "position_ids")}
    inputs |= {"past_key_names": "past_key_values.%d.key", "past_value_names": "past_key_values.%d.value"}
    first_output = HIDDEN if head_outside else "logits"
    outputs = {first_output: first_output, "present_key_names": "present.%d.key", "present_value_names": "present.%d.value"}
    return {
        "model": {
            "type": config.get("model_type", spec.architecture),
            "context_length": spec.max_position_embeddings,
            "vocab_size": spec.vocab_size,
            **{key: config.get(key) for key in ("bos_token_id", "eos_token_id", "pad_token_id")},
            "decoder": {
                "filename": MODEL_FILE,
                "head_size": spec.head_dim,
                "hidden_size": spec.hidden_size,
                "num_attention_heads": spec.num_heads,
                "num_key_value_heads": spec.num_kv_heads,
                "num_hidden_layers": spec.num_layers,
                "inputs": inputs,
                "outputs": outputs,
            },
        },
        "search": {"max_length": spec.max_position_embeddings, "past_present_share_buffer": False},
        "quasar": {
            "format": SIDECAR_FORMAT,
            "precision": precision,
            "activation": scheme.activation if precision == "w8a8" else None,
            "linear": LINEAR_DESCRIPTIONS[linear_format] if linear_format else "float32 MatMul",
            "opset": OPSETS[linear_format or "integer"],
            "ir_version": IR_VERSIONS[OPSETS[linear_format or "integer"]],
            "source_manifest_sha256": sha256_files(files.path / MANIFEST) if files.manifest else None,
        },
    }


def _linear_format(files: ModelFiles, precision: str, linear_format: str) -> str | None:
    """The form of the W8A8 linears (None for a float graph), after refusing what cannot be exported, each in one line."""
    if precision not in ("w8a8", "float"):
        raise QuasarError(f"unknown precision {precision!r}; choose from w8a8, float")
    if linear_format not in LINEAR_FORMATS:
        raise QuasarError(f"unknown ONNX format {linear_format!r}; choose from {', '.join(LINEAR_FORMATS)}")
    if precision == "w8a8" and not files.is_artifact:
        raise QuasarError(f"{files.path}: a float checkpoint; calibrate it first, or export it with --precision float")
    if precision == "float" and files.is_artifact:
        raise QuasarError(f"{files.path}: a W8A8 artifact holds no float weights; pass the source checkpoint with --precision float")
    if precision == "float":
        if linear_format != "integer":
            raise QuasarError(f"--format {linear_format} applies to W8A8 graphs; a float graph has no quantized linears")
        return None
    if linear_format == "qdq" and files.scheme.activation != "static":  # TensorRT and ORT's QDQ fusions need constant scales
        raise QuasarError(
            f"{files.path}: --format qdq needs per-tensor static activation scales, this artifact has "
            f"{files.scheme.activation!r} ones; calibrate with --activation static, or export --format integer"
        )
    return linear_format


def save_graph(model: onnx.ModelProto, directory: Path) -> None:
    """One file up to ``EXTERNAL_DATA_THRESHOLD`` of weights, else weights in ``model.onnx.data``; then checked."""
    external = sum(len(t.raw_data) for t in model.graph.initializer) > EXTERNAL_DATA_THRESHOLD
    onnx.save_model(model, str(directory / MODEL_FILE), save_as_external_data=external, all_tensors_to_one_file=True, location=DATA_FILE)
    onnx.checker.check_model(str(directory / MODEL_FILE))


def source_graph(
    spec: DecoderSpec,
    source: BlockSource,
    name: str,
    external: ExternalData | None,
    progress: bool = False,
    linear_format: str = "integer",
    head_outside: bool = False,
) -> tuple[onnx.ModelProto, set[str]]:
    """The graph built one layer at a time from ``source`` (weights to ``external`` as it goes), and its quantized linears;
    ``head_outside``: a float lm_head is left to the caller and a bf16 table stays bf16."""
    load = tensor_loader(source, torch.float32)
    quantized: set[str] = set()

    def layers() -> Iterator[DecoderLayer]:
        for i in tqdm(range(spec.num_layers), desc="exporting onnx", unit="layer", disable=not progress):
            layer = DecoderLayer(spec, load, spec.layer_prefix(i))
            quantized.update(f"{spec.layer_prefix(i)}.{n}" for n, m in layer.named_modules() if getattr(m, "quantized", False))
            yield layer

    int8_head = f"{HEAD}.weight_scale" in source.names
    outside = head_outside and not int8_head
    table_dtype = BFLOAT16 if outside and source.tensor(EMBEDDINGS).dtype == torch.bfloat16 else FLOAT32

    def rows(tensor: str, dtype: np.dtype = FLOAT32) -> Iterator[tuple[int, np.ndarray]]:
        start = 0
        for block in checked_row_blocks(source, tensor):
            yield start, block.view(torch.int16).numpy().view(BFLOAT16) if dtype == BFLOAT16 else block.float().numpy()
            start += block.shape[0]

    def embed(out: np.ndarray) -> None:
        for start, block in rows(EMBEDDINGS, table_dtype):
            out[start : start + len(block)] = block

    def head_t(out: np.ndarray) -> None:
        for start, block in rows("lm_head.weight"):
            out[:, start : start + len(block)] = block.T

    g = GraphBuilder(linear_format, external)
    norm = RMSNorm(load("model.norm.weight"), spec.rms_norm_eps)
    head: Linear | Fill | str | None = None if spec.tie_word_embeddings else head_t
    if int8_head:  # an int8 head (``--int8-lm-head``), exported as the layers' linears are
        head = load_linear(load, HEAD)
        quantized.add(HEAD)
    elif outside:
        head = HEAD_OUTSIDE
    return build_graph(g, spec, name, rope_inv_freq(spec), embed, layers(), norm, head, table_dtype), quantized


def streamed_graph(
    files: ModelFiles, name: str, external: ExternalData | None, progress: bool, linear_format: str = "integer", head_outside: bool = False
) -> onnx.ModelProto:
    """``source_graph`` of an artifact or checkpoint, its quantized linears checked against the manifest."""
    model, quantized = source_graph(files.spec, files.checkpoint, name, external, progress, linear_format, head_outside)
    if files.manifest and quantized != set(files.manifest["quantized_layers"]):
        odd = sorted(quantized ^ set(files.manifest["quantized_layers"]))[0]
        raise QuasarError(f"{files.path}: layer {odd!r} does not match the manifest (corrupted artifact)")
    return model


def write_graph(directory: Path, build: Callable[[ExternalData | None], onnx.ModelProto], external: bool) -> None:
    """``build(weights file or None)``'s graph saved in ``directory`` (``external``: weights in ``model.onnx.data``)."""
    data = ExternalData(directory / DATA_FILE) if external else None
    try:
        model = build(data)
    finally:
        if data is not None:
            data.close()
    save_graph(model, directory)


def write_head(files: ModelFiles, path: Path) -> None:
    """The float lm_head of ``files`` as stored (the embedding table where tied), for a graph whose head is outside it."""
    source = files.checkpoint
    names = {"weight": EMBEDDINGS if files.spec.tie_word_embeddings else f"{HEAD}.weight", "bias": f"{HEAD}.bias"}
    save_file({key: source.tensor(name).contiguous() for key, name in names.items() if name in source.names}, str(path))


def export(
    files: ModelFiles,
    output: Path,
    precision: str = "w8a8",
    linear_format: str = "integer",
    external: bool | None = None,
    progress: bool = True,
    head_outside: bool = False,
) -> Path:
    """Write the ONNX decoder for ``files`` to the new directory ``output``, one layer at a time.

    ``linear_format``: ``integer`` or ``qdq``; ``external``: weights in ``model.onnx.data`` (default: above
    ``EXTERNAL_DATA_THRESHOLD``); ``head_outside``: a W8A8 graph ending in ``hidden_states``, its float lm_head beside it."""
    linear = _linear_format(files, precision, linear_format)
    if head_outside and precision != "w8a8":
        raise QuasarError("a graph without its lm_head is made of W8A8 artifacts only")
    outside = head_outside and f"{HEAD}.weight_scale" not in files.checkpoint.names
    output = Path(output)
    if external is None:
        external = graph_bytes(files.checkpoint.shapes, files.checkpoint.dtypes) > EXTERNAL_DATA_THRESHOLD
    with atomic_directory(output) as tmp:
        name = f"{files.spec.architecture}-{precision}"
        write_graph(tmp, lambda data: streamed_graph(files, name, data, progress, linear or "integer", outside), external)
        (tmp / CONFIG_FILE).write_text(json.dumps(genai_config(files, precision, linear, outside), indent=2))
        copy_files(files.path, tmp, ("config.json", *TOKENIZER_FILES))
        if outside:
            write_head(files, tmp / HEAD_FILE)
        record = {"precision": precision, "linear_format": linear, **({"head": HEAD_OUTSIDE} if outside else {})}
        write_export_manifest(tmp, "onnx", files.path, record)
    return output
