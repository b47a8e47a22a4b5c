"""The canonical W8A8 artifact on disk, and opening any model directory we can run.

Layout (one directory, written to a temp dir and renamed, so an interrupted
write leaves nothing that loads):

- ``config.json``: the source config plus a compressed-tensors ``quantization_config``
  (``int-quantized``; weights int8 channel-symmetric; activations int8 token-dynamic,
  or tensor-static with ``input_scale``; ``ignore`` lists the float linears), the
  layout vLLM reads as W8A8.
- ``model.safetensors``: quantized linears as ``weight`` int8 [out, in] and
  ``weight_scale`` float32 [out, 1] (+ ``input_scale`` float32 [1] when static);
  everything else (embeddings, norms with the smoothing folded in, float linears,
  lm_head) in the source's float dtype.
- tokenizer files and ``generation_config.json``, copied from the source.
- ``quasar.json``: format version, recipe, per-group alpha and errors, per-layer
  error, calibration-data fingerprint, source checkpoint hash, weights sha256.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from .checkpoint import Checkpoint
from .decoder_spec import DecoderSpec, check_tensor_shapes, decoder_spec
from .errors import QuasarError
from .files import atomic_directory, copy_files, sha256_files
from .model import Decoder
from .scheme import W8A8Scheme

FORMAT_VERSION = 1
MANIFEST = "quasar.json"
WEIGHTS = "model.safetensors"


def compressed_tensors_config(scheme: W8A8Scheme, ignore: list[str]) -> dict:
    """The ``quantization_config`` block compressed-tensors (and vLLM) read for W8A8 int8."""
    dynamic = scheme.activation == "dynamic"
    common = {"num_bits": 8, "type": "int", "symmetric": True, "group_size": None, "block_structure": None, "actorder": None}
    return {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {**common, "strategy": "channel", "dynamic": False, "observer": "minmax"},
                "input_activations": {
                    **common,
                    "strategy": "token" if dynamic else "tensor",
                    "dynamic": dynamic,
                    "observer": None if dynamic else "minmax",
                },
                "output_activations": None,
            }
        },
        "ignore": sorted(ignore),
        "kv_cache_scheme": None,
    }


def write_artifact(decoder: Decoder, source: Checkpoint, output: Path, scheme: W8A8Scheme, manifest: dict) -> Path:
    """Write atomically; ``output`` must not exist yet (we never overwrite a user's files)."""
    output = Path(output)
    with atomic_directory(output) as tmp:
        source_dtype = getattr(torch, source.config.get("torch_dtype") or source.config.get("dtype") or "float32", torch.float32)
        tensors: dict[str, torch.Tensor] = {}
        for name, tensor in decoder.state_dict().items():
            if name == "lm_head.weight" and decoder.spec.tie_word_embeddings:
                continue
            if tensor.dtype == torch.int8 or name.endswith(("weight_scale", "input_scale")):
                tensors[name] = tensor.contiguous()
            else:
                tensors[name] = tensor.to(source_dtype).contiguous()
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
        ignore = ["lm_head"] + [name for name, linear in decoder.linears() if not linear.quantized]
        config = dict(source.config)
        config["quantization_config"] = compressed_tensors_config(scheme, ignore)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        copy_files(source.path, tmp)
        manifest = {"format_version": FORMAT_VERSION, **manifest, "weights_sha256": sha256_files(tmp / WEIGHTS)}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return output


@dataclass
class ModelFiles:
    """A directory we can run: a W8A8 artifact (``manifest`` set) or a plain float checkpoint."""

    checkpoint: Checkpoint
    spec: DecoderSpec
    manifest: dict | None

    @property
    def path(self) -> Path:
        return self.checkpoint.path

    @property
    def is_artifact(self) -> bool:
        return self.manifest is not None

    @property
    def scheme(self) -> W8A8Scheme | None:
        return W8A8Scheme(**self.manifest["recipe"]["scheme"]) if self.manifest else None

    def decoder(self, dtype: torch.dtype = torch.float32) -> Decoder:
        decoder = Decoder(self.spec, self.checkpoint, dtype)
        if self.manifest:
            expected = set(self.manifest["quantized_layers"])
            got = {name for name, linear in decoder.linears() if linear.quantized}
            if expected != got:
                missing = sorted(expected ^ got)[0]
                raise QuasarError(f"{self.path}: layer {missing!r} does not match the manifest (corrupted artifact)")
        return decoder


def open_model_files(path: str | Path, verify: bool = True) -> ModelFiles:
    """Open a W8A8 artifact or a float HF checkpoint; corrupted artifacts fail here, in one line."""
    checkpoint = Checkpoint(path)
    manifest = None
    manifest_file = checkpoint.path / MANIFEST
    if manifest_file.exists():
        try:
            manifest = json.loads(manifest_file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise QuasarError(f"{manifest_file}: not valid JSON (corrupted artifact)") from None
        if manifest.get("format_version") != FORMAT_VERSION:
            raise QuasarError(
                f"{manifest_file}: artifact format {manifest.get('format_version')!r}, this quasar-deploy reads {FORMAT_VERSION}"
            )
        if verify and sha256_files(checkpoint.path / WEIGHTS) != manifest.get("weights_sha256"):
            raise QuasarError(f"{checkpoint.path / WEIGHTS}: checksum mismatch (corrupted or modified artifact)")
    spec = decoder_spec(checkpoint.config, checkpoint.names)
    check_tensor_shapes(spec, checkpoint.shapes)
    return ModelFiles(checkpoint, spec, manifest)
