"""The canonical W8A8 artifact on disk, and opening any model directory we can run.

One directory, written atomically: ``config.json`` with a compressed-tensors ``quantization_config``, safetensors
weights (int8 ``weight`` and float32 ``weight_scale`` per quantized linear), tokenizer files, and ``quasar.json``, whose
``files`` hold the sha256 of every other file (docs/usage.md, "The artifact"). Opening checks the manifest before
anything trusts it; quantized weights without one are refused, so deleting ``quasar.json`` cannot turn the checks off."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from .checkpoint import Checkpoint
from .decoder_spec import DecoderSpec, check_tensor_shapes, decoder_spec
from .errors import QuasarError
from .files import atomic_directory, copy_files, model_directory
from .integrity import EXPORT_MANIFEST, MANIFEST, read_manifest, write_manifest
from .model import HEAD, BlockSource, Decoder, check_finite
from .scheme import W8A8Scheme
from .shards import MAX_SHARD_SIZE, TORCH_DTYPES, ShardWriter

FORMAT_VERSION = 2  # 2: ``files`` (per-file sha256) replaced ``weights_sha256``
# what loading reads from a manifest, checked at open so a damaged one is one line, not a KeyError
RECORD_FIELDS = {"recipe": dict, "quantized_layers": list}
QUANTIZED_DTYPES = ("I8", "U8", "F8_E4M3", "F8_E5M2")


def compressed_tensors_config(scheme: W8A8Scheme, ignore: list[str]) -> dict:
    """The ``quantization_config`` block compressed-tensors (and vLLM) read for W8A8 int8."""
    dynamic = scheme.activation == "dynamic"
    common = {"num_bits": 8, "type": "int", "symmetric": True, "group_size": None, "block_structure": None, "actorder": None}
    activations = {**common, "strategy": "token" if dynamic else "tensor", "dynamic": dynamic, "observer": None if dynamic else "minmax"}
    weights = {**common, "strategy": "channel", "dynamic": False, "observer": "minmax"}
    group = {"targets": ["Linear"], "weights": weights, "input_activations": activations, "output_activations": None}
    config = {"quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed"}
    return config | {"config_groups": {"group_0": group}, "ignore": sorted(ignore), "kv_cache_scheme": None}


def artifact_config(config: dict, scheme: W8A8Scheme, quantized_layers: Iterable[str], float_linears: Iterable[str]) -> dict:
    """The source's config plus the ``quantization_config`` (``ignore``: float linears, and a float lm_head); an int8 head
    is its own tensor, so the config then says ``tie_word_embeddings: false``."""
    head_quantized = HEAD in quantized_layers
    ignore = [*float_linears] + ([] if head_quantized else [HEAD])
    out = {**config, "quantization_config": compressed_tensors_config(scheme, ignore)}
    if head_quantized:
        out["tie_word_embeddings"] = False
    return out


class ArtifactWriter:
    """An artifact being written, tensor by tensor (float ones in the source's dtype), then the rest (``finish``)."""

    def __init__(self, directory: Path, source: Checkpoint, max_shard_size: int):
        self.directory, self.source = directory, source
        self.shards = ShardWriter(directory, max_shard_size)

    def _dtype(self, name: str, dtype: torch.dtype) -> torch.dtype:
        if dtype == torch.int8 or name.endswith(("weight_scale", "input_scale")) or name not in self.source.dtypes:
            return dtype
        return TORCH_DTYPES[self.source.dtypes[name]]

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self.shards.add(name, tensor.to("cpu", self._dtype(name, tensor.dtype)))

    def copy(self, name: str) -> None:
        """Copy the source's tensor as it is stored, block by block, refusing NaN and infinity as loading would."""
        self.shards.add_blocks(
            name, TORCH_DTYPES[self.source.dtypes[name]], self.source.shapes[name], checked_row_blocks(self.source, name)
        )

    def finish(self, scheme: W8A8Scheme, float_linears: list[str], manifest: dict) -> None:
        """Everything but the weights; the manifest last, since it lists every other file."""
        self.shards.close()
        config = artifact_config(self.source.config, scheme, manifest["quantized_layers"], float_linears)
        (self.directory / "config.json").write_text(json.dumps(config, indent=2))
        copy_files(self.source.path, self.directory)
        write_manifest(self.directory, MANIFEST, {"format_version": FORMAT_VERSION, **manifest})


def checked_row_blocks(source: BlockSource, name: str) -> Iterator[torch.Tensor]:
    """``source.row_blocks(name)``, each block refused if it holds NaN or infinity, as loading would refuse it."""
    for block in source.row_blocks(name):
        check_finite(name, block)
        yield block


@contextmanager
def writing_artifact(source: Checkpoint, output: Path, max_shard_size: int = MAX_SHARD_SIZE) -> Iterator[ArtifactWriter]:
    """An ``ArtifactWriter`` into a temp directory that becomes ``output`` once the block ends (``output`` must not exist yet)."""
    with atomic_directory(Path(output)) as tmp:
        yield ArtifactWriter(tmp, source, max_shard_size)


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
    def listed(self) -> dict[str, str] | None:
        """The sha256 the manifest lists (None: a float checkpoint), against which readers check the small files they read."""
        return self.manifest["files"] if self.manifest else None

    @property
    def scheme(self) -> W8A8Scheme | None:
        return W8A8Scheme(**self.manifest["recipe"]["scheme"]) if self.manifest else None

    def decoder(self, dtype: torch.dtype = torch.float32, head_dtype: torch.dtype | None = None) -> Decoder:
        decoder = Decoder(self.spec, self.checkpoint, dtype, head_dtype=head_dtype)
        if self.manifest:
            expected = set(self.manifest["quantized_layers"])
            got = {name for name, linear in decoder.linears() if linear.quantized} | ({HEAD} if decoder.lm_head.quantized else set())
            if expected != got:
                missing = sorted(expected ^ got)[0]
                raise QuasarError(f"{self.path}: layer {missing!r} does not match the manifest (corrupted artifact)")
        return decoder


def open_model_files(path: str | Path) -> ModelFiles:
    """Open a W8A8 artifact or a float HF checkpoint; corrupted, modified or foreign quantized directories fail here, in one line."""
    directory = model_directory(path)
    if (directory / EXPORT_MANIFEST).exists() or (directory / EXPORT_MANIFEST).is_symlink():
        raise QuasarError(f"{directory}: an export ({EXPORT_MANIFEST}), not an artifact; pass the artifact it was exported from")
    manifest = None
    if (directory / MANIFEST).exists() or (directory / MANIFEST).is_symlink():
        manifest = read_manifest(directory, MANIFEST, FORMAT_VERSION)
        scheme = _check_record(directory / MANIFEST, manifest)
    checkpoint = Checkpoint(directory)
    if manifest is None:
        _refuse_foreign_quantized(checkpoint)
    spec = decoder_spec(checkpoint.config, checkpoint.names)
    check_tensor_shapes(spec, checkpoint.shapes)
    if manifest is not None:
        _check_activation(checkpoint, manifest["quantized_layers"], scheme)
    return ModelFiles(checkpoint, spec, manifest)


def _check_record(file: Path, manifest: dict) -> W8A8Scheme:
    """The fields the code reads have their types, and the scheme is one we run; returns the scheme."""
    for field, kind in RECORD_FIELDS.items():
        if not isinstance(manifest.get(field), kind):
            raise QuasarError(f"{file}: {field!r} is missing or not a JSON {'object' if kind is dict else 'array'} (corrupted manifest)")
    if not all(isinstance(name, str) for name in manifest["quantized_layers"]):
        raise QuasarError(f"{file}: 'quantized_layers' must list layer names (corrupted manifest)")
    scheme = manifest["recipe"].get("scheme")
    try:
        return W8A8Scheme(**scheme)
    except (TypeError, ValueError) as exc:
        raise QuasarError(f"{file}: recipe.scheme {scheme!r} is not a W8A8 scheme this quasar-deploy runs ({exc})") from None


def _check_activation(checkpoint: Checkpoint, quantized_layers: list, scheme: W8A8Scheme) -> None:
    """Static activations need an ``input_scale`` on every quantized layer, dynamic ones none: else the backends would disagree."""
    with_scale = {name.removesuffix(".input_scale") for name in checkpoint.names if name.endswith(".input_scale")}
    expected = set(quantized_layers) if scheme.activation == "static" else set()
    if with_scale != expected:
        name = sorted(with_scale ^ expected, key=str)[0]
        has = "has" if name in with_scale else "lacks"
        raise QuasarError(f"{checkpoint.path / MANIFEST}: {scheme.activation!r} activations, but {name} {has} an input_scale (corrupted)")


def _refuse_foreign_quantized(checkpoint: Checkpoint) -> None:
    """Without our manifest, quantized weights would run as float (or not at all): we run only the artifacts we write."""
    config = checkpoint.config.get("quantization_config") if isinstance(checkpoint.config, dict) else None
    int8 = next((name for name, dtype in sorted(checkpoint.dtypes.items()) if dtype in QUANTIZED_DTYPES), None)
    if config is None and int8 is None:
        return
    if config is None:
        what = f"{int8} is {checkpoint.dtypes[int8]}"
    else:
        what = f"config.json has a quantization_config, quant_method {config.get('quant_method') if isinstance(config, dict) else None!r}"
    raise QuasarError(
        f"{checkpoint.path}: quantized ({what}) but no {MANIFEST}: quasar-deploy runs only the W8A8 artifacts it writes, "
        "not other tools' compressed-tensors or quantized checkpoints; pass the float checkpoint (and calibrate it)"
    )
