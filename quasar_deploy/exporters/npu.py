"""Export a W8A8 artifact to msModelSlim's AscendV1 layout, which vLLM-Ascend serves with ``quantization="ascend"``.

The layout tensor by tensor, and the static numerics (``deq_scale``, ``quant_bias``): docs/npu.md. The smoothing is
already folded into the norms and ``v_proj`` / ``up_proj`` rows, so no ``norm.bias`` is written."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tqdm import tqdm

from ..artifact import HEAD, ModelFiles
from ..errors import QuasarError
from ..files import atomic_directory, copy_files, require_new
from ..integrity import write_export_manifest
from ..shards import MAX_SHARD_SIZE, ShardWriter, shard_names
from .layers import by_layer

DESCRIPTION = "quant_model_description.json"
STEM = "quant_model_weights"
WEIGHTS = shard_names(1, STEM)[0]
FORMAT_VERSION = "1.0.0"
QUANT_TYPES = {"dynamic": "W8A8_DYNAMIC", "static": "W8A8"}
EXPORT_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
FUSED_GROUPS = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj"))


def export_dtype(requested: str | None, activation: str) -> str:
    """The export's model dtype: bfloat16, or float16 on request for the static scheme (vLLM-Ascend's dynamic one can't)."""
    if requested is None:
        return "bfloat16"
    if requested not in EXPORT_DTYPES:
        raise QuasarError(f"--dtype for the npu target must be one of {', '.join(EXPORT_DTYPES)}, not {requested!r}")
    if requested == "float16" and activation == "dynamic":
        raise QuasarError(
            "--dtype float16 applies to static artifacts only: vLLM-Ascend's W8A8_DYNAMIC matmul gets its weight scale in the "
            "model dtype, which torch_npu takes with per-token scales only as float32; export as bfloat16 (the default)"
        )
    return requested


def encode_deq_scale(deq_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 for bfloat16 models; for float16, the float32 bit pattern widened to int64 (msModelSlim's encoding)."""
    deq_scale = deq_scale.float().contiguous()
    if dtype == torch.bfloat16:
        return deq_scale
    return deq_scale.view(torch.int32).to(torch.int64)


def check_fused_groups(files: ModelFiles, quantized: set[str]) -> None:
    """vLLM fuses q/k/v and gate/up into one layer each, with one quant type and one static input scale per fused layer."""
    for i in range(files.spec.num_layers):
        prefix = files.spec.layer_prefix(i)
        for group in FUSED_GROUPS:
            names = [f"{prefix}.{name}" for name in group]
            kinds = {name in quantized for name in names}
            if len(kinds) > 1:
                odd = next(name for name in names if (name in quantized) != (names[0] in quantized))
                raise QuasarError(
                    f"{files.path}: vLLM-Ascend fuses {', '.join(names)} into one layer, so they must be all quantized or all float"
                    f" ({odd} differs); recalibrate with --keep-float covering the whole group"
                )
            if files.scheme.activation == "static" and names[0] in quantized:
                scales = {float(files.checkpoint.tensor(f"{name}.input_scale").reshape(-1)[0]) for name in names}
                if len(scales) > 1:
                    raise QuasarError(f"{files.path}: {', '.join(names)} share an input but have different static input scales")


def quantized_tensors(prefix: str, files: ModelFiles, activation: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """One quantized linear's tensors under msModelSlim's names."""
    ckpt = files.checkpoint
    wq = ckpt.tensor(f"{prefix}.weight")
    w_scale = ckpt.tensor(f"{prefix}.weight_scale").float().reshape(-1, 1)
    bias = ckpt.tensor(f"{prefix}.bias") if f"{prefix}.bias" in ckpt.names else None
    out = {f"{prefix}.weight": wq.contiguous(), f"{prefix}.weight_scale": w_scale.contiguous()}
    out[f"{prefix}.weight_offset"] = torch.zeros_like(w_scale)
    if bias is not None:
        out[f"{prefix}.bias"] = bias.to(dtype).contiguous()
    if activation == "static":
        input_scale = ckpt.tensor(f"{prefix}.input_scale").float().reshape(1).to(dtype)
        deq_scale = input_scale.float() * w_scale.reshape(-1)
        quant_bias = torch.zeros(wq.shape[0], dtype=torch.int32)
        if bias is not None:
            steps = torch.round(bias.double() / deq_scale.double())
            if steps.abs().max() > torch.iinfo(torch.int32).max:
                raise QuasarError(f"{files.path}: {prefix}.bias does not fit an int32 quant_bias at its dequantization scale")
            quant_bias = steps.to(torch.int32)
        out[f"{prefix}.input_scale"] = input_scale
        out[f"{prefix}.input_offset"] = torch.zeros(1, dtype=dtype)
        out[f"{prefix}.quant_bias"] = quant_bias
        out[f"{prefix}.deq_scale"] = encode_deq_scale(deq_scale, dtype)
    return out


def export(files: ModelFiles, output: Path, dtype: str | None = None, max_shard_size: int = MAX_SHARD_SIZE, progress: bool = True) -> Path:
    """Write the AscendV1 (msModelSlim) export of ``files`` to ``output`` (which must not exist), one layer at a time."""
    if not files.is_artifact:
        raise QuasarError(f"{files.path}: not a W8A8 artifact; run `quasar-deploy calibrate` first")
    dtype = export_dtype(dtype, files.scheme.activation)
    output = require_new(output)
    torch_dtype = EXPORT_DTYPES[dtype]
    quantized = set(files.manifest["quantized_layers"])
    if HEAD in quantized:  # vLLM-Ascend's lm_head is a ParallelLMHead, not a Linear its W8A8 methods run
        raise QuasarError(
            f"{files.path}: has an int8 lm_head (calibrate --int8-lm-head), which msModelSlim's W8A8 layouts do not cover "
            "for vLLM-Ascend; calibrate without --int8-lm-head for the npu target"
        )
    check_fused_groups(files, quantized)

    config = {key: value for key, value in files.checkpoint.config.items() if key != "quantization_config"} | {"torch_dtype": dtype}
    if "dtype" in config:  # transformers >= 4.56 writes "dtype"; both must name the export's type
        config["dtype"] = dtype

    with atomic_directory(output) as tmp:
        writer = ShardWriter(tmp, max_shard_size, STEM)
        description = _write_weights(files, writer, quantized, torch_dtype, progress)
        writer.close()
        (tmp / DESCRIPTION).write_text(json.dumps(description, indent=2))
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        copy_files(files.path, tmp)
        write_export_manifest(tmp, "npu", files.path)
    return output


def _write_weights(files: ModelFiles, writer: ShardWriter, quantized: set[str], dtype: torch.dtype, progress: bool) -> dict[str, str]:
    """Every tensor into ``writer``, layer by layer; returns the description's type per tensor."""
    ckpt, activation = files.checkpoint, files.scheme.activation
    quant_type = QUANT_TYPES[activation]
    description: dict[str, str] = {"model_quant_type": quant_type, "version": FORMAT_VERSION}
    if files.spec.tie_word_embeddings:
        description[f"{HEAD}.weight"] = "FLOAT"  # looked up though no such tensor exists (docs/npu.md)
    groups = by_layer(ckpt.names, files.spec)
    for _, names in tqdm(groups, desc="exporting npu", unit="layer", disable=not progress):
        for name in names:
            owner = name.rsplit(".", 1)[0]
            if owner not in quantized:
                shape = ckpt.shapes[name]
                writer.add_blocks(name, dtype, shape, (block.to(dtype) for block in ckpt.row_blocks(name)))
                description[name] = "FLOAT"
            elif name == f"{owner}.weight":
                for key, tensor in quantized_tensors(owner, files, activation, dtype).items():
                    writer.add(key, tensor)
                    description[key] = quant_type
    return description
