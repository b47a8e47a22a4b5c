"""Function-preserving inflation: a small trained decoder placed inside a larger shape that computes exactly its function.

Why: the demo model sits in the CPU caches, where int8 weights save no bandwidth; inflated to a published model's width
and depth, every step reads that model's bytes while the outputs stay the trained model's. With r = H'/H:

- Residual stream: r copies of the source's channels (the same RMS, so RMSNorm's epsilon holds); embeddings and lm_head
  repeat their columns, o_proj and down_proj their rows (and int8 scales); norm weights are zero past the first copy.
- Extra query/key heads and gate_proj rows are random; extra value heads and up_proj rows, and the o_proj and down_proj
  columns they feed, are zero. Extra layers: random q/k/v/gate/up, unit norms, zero o_proj and down_proj, in layer 0's
  dtypes and form. head_dim and the vocabulary are kept.

W8A8 stays bit-exact: every quantized linear reads the source's input padded with zeros, so the int8 activations and
integer sums are the source's; a float model's logits equal the source's within float32 rounding."""

from __future__ import annotations

import datetime
import json
import zlib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from tqdm import tqdm

from ._version import __version__
from .artifact import FORMAT_VERSION, HEAD, MANIFEST, ModelFiles, artifact_config, open_model_files
from .decoder_spec import ATTENTION_LINEARS, MLP_LINEARS, DecoderSpec, expected_shapes
from .errors import QuasarError
from .files import atomic_directory, copy_files, sha256_files
from .integrity import write_manifest
from .scheme import quantize_weight
from .shapes import SHAPES
from .shards import TORCH_DTYPES, ShardWriter

RESIDUAL_WRITERS = ("o_proj", "down_proj")  # their rows are the residual stream's channels: repeated r times
ZERO_NEW_ROWS = ("v_proj", "up_proj")  # zero outputs keep the extra heads' and MLP channels' contribution zero
INIT_STD = 0.02  # the random weights' standard deviation, as published initialisations use
CONFIG_KEY = "quasar_inflation"  # config.json's record of how the model was inflated (Hugging Face ignores unknown keys)


@dataclass(frozen=True)
class InflationTarget:
    """The larger body the source is placed in; head_dim and vocabulary stay the source's."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


def body_of(shape: str, spec: DecoderSpec) -> InflationTarget:
    """A published shape's body (``shapes.SHAPES``) with its query and KV widths in heads of ``spec``'s head_dim."""
    hidden, inner, layers, heads, kv_heads, head_dim, _, _ = SHAPES[shape]
    if (heads * head_dim) % spec.head_dim or (kv_heads * head_dim) % spec.head_dim:
        raise QuasarError(f"{shape}: its query width {heads * head_dim} is not a whole number of heads of head_dim {spec.head_dim}")
    return InflationTarget(hidden, inner, layers, heads * head_dim // spec.head_dim, kv_heads * head_dim // spec.head_dim)


def inflated_spec(spec: DecoderSpec, target: InflationTarget) -> DecoderSpec:
    """``spec`` grown to ``target``, refused in one line where no function-preserving placement exists."""
    if target.hidden_size % spec.hidden_size:
        raise QuasarError(f"inflation: hidden_size {target.hidden_size} is not a multiple of the source's {spec.hidden_size}")
    for field in ("intermediate_size", "num_layers", "num_heads", "num_kv_heads"):
        if getattr(target, field) < getattr(spec, field):
            raise QuasarError(f"inflation: {field} {getattr(target, field)} is below the source's {getattr(spec, field)}")
    if target.num_heads * spec.num_kv_heads != spec.num_heads * target.num_kv_heads:
        raise QuasarError(
            f"inflation: {target.num_heads} query heads over {target.num_kv_heads} KV heads must keep the source's "
            f"{spec.num_heads // spec.num_kv_heads} query heads per KV head (else its heads would read other keys)"
        )
    return replace(spec, **target.to_dict())


def inflated_dtype(dtypes: Mapping[str, str], name: str) -> str:
    """The stored dtype (safetensors name) of inflated tensor ``name``: the source's, or layer 0's for a new layer's."""
    if name not in dtypes:
        name = ".".join(["model", "layers", "0", *name.split(".")[3:]])
    return dtypes[name]


class _Inflater:
    """The inflated tensors of one source (float checkpoint or W8A8 artifact), produced one at a time."""

    def __init__(self, files: ModelFiles, target: InflationTarget, seed: int):
        spec = files.spec
        self.files, self.source, self.small, self.seed = files, files.checkpoint, spec, seed
        self.big = inflated_spec(spec, target)
        self.copies = target.hidden_size // spec.hidden_size
        self.shapes = expected_shapes(self.big)
        # random int8 rows quantize the float model's values, stored in its embeddings' dtype
        self.float_dtype = TORCH_DTYPES[self.source.dtypes["model.embed_tokens.weight"]]
        biased = sorted(name for name in self.source.names if name.endswith(".bias"))
        if biased:
            raise QuasarError(f"{files.path}: inflation supports bias-free decoders, and {biased[0]} is a bias")
        if files.is_artifact and files.scheme.activation != "dynamic":
            raise QuasarError(f"{files.path}: inflation supports dynamic-activation artifacts (new layers would need static input scales)")

    def _dtype(self, name: str) -> torch.dtype:
        return TORCH_DTYPES[inflated_dtype(self.source.dtypes, name)]

    def _random(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """normal(0, INIT_STD) from a generator seeded by the tensor's name: a float model and its artifact get the same values."""
        generator = torch.Generator().manual_seed(self.seed * 2**32 + zlib.crc32(name.encode()))
        return (torch.randn(shape, generator=generator) * INIT_STD).to(dtype)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield "model.embed_tokens.weight", self.source.tensor("model.embed_tokens.weight").repeat(1, self.copies)
        for layer in range(self.big.num_layers):
            yield from self._layer(layer)
        yield "model.norm.weight", self._norm("model.norm.weight", new=False)
        if "lm_head.weight" in self.source.names:  # an int8 head (``--int8-lm-head``) too: its rows' absmax and scales stay
            yield "lm_head.weight", self.source.tensor("lm_head.weight").repeat(1, self.copies)
        if "lm_head.weight_scale" in self.source.names:
            yield "lm_head.weight_scale", self.source.tensor("lm_head.weight_scale")

    def _layer(self, layer: int) -> Iterator[tuple[str, torch.Tensor]]:
        prefix, new = self.big.layer_prefix(layer), layer >= self.small.num_layers
        for norm in ("input_layernorm", "post_attention_layernorm"):
            yield f"{prefix}.{norm}.weight", self._norm(f"{prefix}.{norm}.weight", new)
        if self.small.qk_norm:
            for norm in ("q_norm", "k_norm"):
                name = f"{prefix}.self_attn.{norm}.weight"
                yield name, torch.ones(self.shapes[name], dtype=self._dtype(name)) if new else self.source.tensor(name)
        for kind in ATTENTION_LINEARS + MLP_LINEARS:
            linear = f"{prefix}.{'self_attn' if kind in ATTENTION_LINEARS else 'mlp'}.{kind}"
            weight, scale = self._linear(linear, kind, new)
            yield f"{linear}.weight", weight
            if scale is not None:
                yield f"{linear}.weight_scale", scale

    def _norm(self, name: str, new: bool) -> torch.Tensor:
        dtype = self._dtype(name)
        if new:
            return torch.ones(self.big.hidden_size, dtype=dtype)
        weight = torch.zeros(self.big.hidden_size, dtype=dtype)
        weight[: self.small.hidden_size] = self.source.tensor(name)
        return weight

    def _linear(self, linear: str, kind: str, new: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(weight, int8 scale or None) of one linear of the inflated model."""
        name = f"{linear}.weight"
        shape, dtype = self.shapes[name], self._dtype(name)
        if kind in RESIDUAL_WRITERS:
            if new:
                return _zeros(shape, dtype)
            weight, scale = self.source.tensor(name), self._scale(linear)
            weight = torch.nn.functional.pad(weight.repeat(self.copies, 1), (0, shape[1] - weight.shape[1]))
            return weight, None if scale is None else scale.repeat(self.copies, 1)
        if kind in ZERO_NEW_ROWS and not new:
            weight, scale = _zeros(shape, dtype)
        else:
            weight = self._random(name, shape, self.float_dtype if dtype == torch.int8 else dtype)
            weight, scale = quantize_weight(weight) if dtype == torch.int8 else (weight, None)
        if not new:
            source = self.source.tensor(name)
            rows, columns = source.shape
            weight[:rows] = 0
            weight[:rows, :columns] = source
            if scale is not None:
                scale[:rows] = self._scale(linear)
        return weight, scale

    def _scale(self, linear: str) -> torch.Tensor | None:
        name = f"{linear}.weight_scale"
        return self.source.tensor(name).float() if name in self.source.names else None


def _zeros(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A zero weight; int8 ones get scale 1 (scales must be positive; a zero weight makes any scale exact)."""
    return torch.zeros(shape, dtype=dtype), torch.ones(shape[0], 1) if dtype == torch.int8 else None


@contextmanager
def _writing(files: ModelFiles, output: Path, target: InflationTarget, seed: int, progress: bool) -> Iterator[tuple[Path, list[str]]]:
    """The inflated files of ``files`` in a temp dir that becomes ``output``; the block adds the manifest."""
    inflater = _Inflater(files, target, seed)
    quantized = []
    with atomic_directory(Path(output)) as tmp:
        writer = ShardWriter(tmp)
        weights = [name for name in inflater.shapes if name.endswith(".weight")]
        with tqdm(total=len(weights), desc="inflating", unit="weight", disable=not progress) as bar:
            for name, tensor in inflater.tensors():
                writer.add(name, tensor.contiguous())
                if tensor.dtype == torch.int8:
                    quantized.append(name.removesuffix(".weight"))
                bar.update(name.endswith(".weight"))
        writer.close()
        (tmp / "config.json").write_text(json.dumps(_config(files, target, seed, inflater, quantized), indent=2))
        copy_files(files.path, tmp)
        yield tmp, quantized


def _config(files: ModelFiles, target: InflationTarget, seed: int, inflater: _Inflater, quantized: list[str]) -> dict:
    """The source's config.json with the target's dimensions, a record of the inflation, and the new float layers ignored."""
    config = dict(files.checkpoint.config)
    config.pop("layer_types", None)  # one attention kind per source layer; every layer here is full attention
    config.update(hidden_size=target.hidden_size, intermediate_size=target.intermediate_size, num_hidden_layers=target.num_layers)
    config.update(num_attention_heads=target.num_heads, num_key_value_heads=target.num_kv_heads, head_dim=files.spec.head_dim)
    config[CONFIG_KEY] = {"source": str(files.path), "source_sha256": files.checkpoint.fingerprint(), "seed": seed}
    if files.is_artifact:
        linears = [name.removesuffix(".weight") for name in inflater.shapes if name.endswith("_proj.weight")]
        config = artifact_config(config, files.scheme, quantized, [n for n in linears if n not in set(quantized)])
    return config


def inflate_checkpoint(model: str | Path, output: str | Path, target: InflationTarget, seed: int = 0, progress: bool = True) -> Path:
    """The float checkpoint ``model`` inflated to ``target``, written (atomically, tensor by tensor) to ``output``."""
    files = open_model_files(model)
    if files.is_artifact:
        raise QuasarError(f"{model}: a W8A8 artifact; inflate it with inflate_artifact (it records its inflated float model)")
    with _writing(files, Path(output), target, seed, progress):
        pass
    return Path(output)


def inflate_artifact(
    artifact: str | Path, output: str | Path, target: InflationTarget, inflated_model: str | Path, seed: int = 0, progress: bool = True
) -> Path:
    """The W8A8 ``artifact`` inflated to ``target`` at ``output``, recording ``inflated_model`` as its source."""
    files = open_model_files(artifact)
    if not files.is_artifact:
        raise QuasarError(f"{artifact}: not a W8A8 artifact (no {MANIFEST}); inflate a float checkpoint with inflate_checkpoint")
    model = open_model_files(inflated_model)
    expected = inflated_spec(files.spec, target)
    if HEAD in files.manifest["quantized_layers"]:  # its int8 head is stored apart even where the float model ties it
        expected = replace(expected, tie_word_embeddings=model.spec.tie_word_embeddings)
    if model.is_artifact or replace(model.spec, architecture=expected.architecture) != expected:
        raise QuasarError(f"{inflated_model}: not the float model inflated to {target.to_dict()} (its shape differs)")
    with _writing(files, Path(output), target, seed, progress) as (tmp, quantized):
        record = {key: value for key, value in files.manifest.items() if key not in ("files", "format_version")}
        record |= {
            "quasar_deploy_version": __version__,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "source": {"path": str(model.path), "architecture": model.spec.architecture, "sha256": model.checkpoint.fingerprint()},
            "quantized_layers": quantized,
            "inflation": {
                "what": "an inflated W8A8 artifact: the calibrated artifact below, its int8 weights and scales placed "
                "function-preservingly in a larger shape whose extra weights (random or zero) add nothing to the outputs; "
                "not a calibration of random weights. recipe, calibration, groups and layers are that artifact's.",
                "artifact": str(files.path),
                "artifact_manifest_sha256": sha256_files(files.path / MANIFEST),
                "calibrated_from": files.manifest.get("source"),
                "target": target.to_dict(),
                "seed": seed,
            },
        }
        write_manifest(tmp, MANIFEST, {"format_version": FORMAT_VERSION, **record})
    return Path(output)
