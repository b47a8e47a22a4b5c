"""The npu export read the way vLLM-Ascend's loader reads it at the version docker/npu pins, for each model family.

The loader's lookups are encoded below as they are written at vllm-project/vllm-ascend tag v0.23.0,
``vllm_ascend/quantization/modelslim_config.py``: ``AscendModelSlimConfig.get_quant_method`` (a
``VocabParallelEmbedding`` without a description entry of its own is unquantized, ``_has_quant_weight``),
``is_layer_skipped_ascend`` (a packed layer looks up each shard's ``.weight`` directly, so a missing key is a
KeyError; any other layer is float when any ``FLOAT`` ``*.weight`` key starts with its prefix) and
``get_linear_quant_type`` (the quant type is ``description[prefix + ".weight"]``, shard by shard for packed layers).
The parameters each scheme declares are ``methods/w8a8_dynamic.py`` and ``methods/w8a8_static.py`` at that tag.

The prefixes are the modules vLLM builds (vllm-project/vllm ``vllm/model_executor/models``): ``LlamaModel`` builds its
``embed_tokens`` without a prefix (the quant config is asked about ``""``) and ``LlamaForCausalLM`` always builds a
``ParallelLMHead`` under ``lm_head``, tying it to the embeddings afterwards; ``Qwen2Model`` (Qwen3's base) builds
``model.embed_tokens`` and a tied ``Qwen3ForCausalLM`` uses the embedding as its head (no ``lm_head`` module). Both
pack q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj``.

At the earlier tag v0.10.0rc1 (``quant_config.py``) every lookup was ``description[prefix + ".weight"]``, so Llama
failed on ``".weight"`` and a tied Llama on ``"lm_head.weight"``; the prefix-matching rule arrived in v0.16.0rc1, which
is why docker/npu pins v0.23.0. The main branch after v0.23.0 dropped the embedding's ``_has_quant_weight`` check
again, so a tied Llama needs its ``"lm_head.weight": "FLOAT"`` entry there: the export writes it for every tied model.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import quasar_deploy
from quasar_deploy.errors import QuasarError
from quasar_deploy.exporters import export
from quasar_deploy.exporters.npu import DESCRIPTION

from .helpers import FAST_CALIBRATION
from .tiny import save_tiny

PINNED_TAG = "v0.23.0"  # the rules below were read at this tag; a new pin means reading the loader again
NPU_DOCKERFILE = Path(__file__).resolve().parent.parent / "docker" / "npu" / "Dockerfile"
PACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
NORMS = {
    "llama": ("input_layernorm", "post_attention_layernorm"),
    "qwen3": ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm"),
}
SCHEMES = ("W8A8_DYNAMIC", "W8A8")  # the linear schemes registered for what we export
INTS = (torch.int8, torch.int32, torch.int64)


def vllm_modules(config: dict) -> list[tuple[str, str, str]]:
    """(kind, module path, prefix the quant config is asked about) of what vLLM builds for the family."""
    llama = config["model_type"] == "llama"
    modules = [("embedding", "model.embed_tokens", "" if llama else "model.embed_tokens")]
    for i in range(config["num_hidden_layers"]):
        modules += [("linear", f"model.layers.{i}.{name}", f"model.layers.{i}.{name}") for name in LINEARS]
        modules += [("norm", f"model.layers.{i}.{name}", "") for name in NORMS[config["model_type"]]]
    modules.append(("norm", "model.norm", ""))
    if llama or not config.get("tie_word_embeddings"):
        modules.append(("embedding", "lm_head", "lm_head"))  # ParallelLMHead subclasses VocabParallelEmbedding
    return modules


def is_layer_skipped(description: dict, prefix: str) -> bool:
    proj = prefix.split(".")[-1]
    if proj in PACKED:
        skipped = {description[prefix.replace(proj, shard) + ".weight"] == "FLOAT" for shard in PACKED[proj]}
        if len(skipped) > 1:
            raise ValueError(f"Detected some but not all shards of {prefix} are quantized")
        return skipped.pop()
    return any(key.startswith(prefix) and key.endswith(".weight") and value == "FLOAT" for key, value in description.items())


def linear_quant_type(description: dict, prefix: str) -> str:
    proj = prefix.split(".")[-1]
    if proj not in PACKED:
        return description[prefix + ".weight"]
    types = {description[prefix.replace(proj, shard) + ".weight"] for shard in PACKED[proj]}
    if len(types) > 1:
        raise ValueError(f"Not all shards of {prefix} are quantized with same quant type")
    return types.pop()


def quant_method(description: dict, kind: str, prefix: str) -> str:
    """The scheme vLLM-Ascend picks for the module ("FLOAT": unquantized); raises where the loader would. RMSNorm is never
    asked; a ``norm.bias`` key anywhere in the description gives every RMSNorm a bias to load and switches it to the
    quantizing anti-outlier kernel (``vllm_ascend/ops/layernorm.py`` at the tag), so none may appear."""
    if kind == "norm":
        assert not any("norm.bias" in key for key in description), "a norm.bias key switches RMSNorm to the quantizing one"
        return "FLOAT"
    if kind == "embedding" and f"{prefix}.weight" not in description:
        return "FLOAT"
    if is_layer_skipped(description, prefix):
        return "FLOAT"
    quant_type = linear_quant_type(description, prefix)
    assert kind == "linear", f"{prefix!r}: vLLM-Ascend would build a quantized embedding ({quant_type})"
    assert quant_type in SCHEMES, f"{prefix}: no linear scheme {quant_type!r}"
    return quant_type


def declared(method: str, dtype: torch.dtype, n: int, k: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """The parameters a layer of that method declares (weight [n, k]); float ones hold the model dtype."""
    if method == "FLOAT":
        return {"weight": (dtype, (n, k))}
    params = {"weight": (torch.int8, (n, k)), "weight_scale": (dtype, (n, 1)), "weight_offset": (dtype, (n, 1))}
    if method == "W8A8":
        params |= {"input_scale": (dtype, (1,)), "input_offset": (torch.int8, (1,)), "quant_bias": (torch.int32, (n,))}
        params["deq_scale"] = (torch.float32 if dtype == torch.bfloat16 else torch.int64, (n,))
    return params


def load_as_vllm_ascend(export_dir: Path, source_shapes: dict[str, tuple[int, ...]]) -> dict[str, str]:
    """Check ``export_dir`` against the loader's rules; returns the method chosen per module. ``source_shapes``: the
    float checkpoint's weight shapes (the unpacked projections' [n, k], as vLLM sizes its shards)."""
    config = json.loads((export_dir / "config.json").read_text())
    description = json.loads((export_dir / DESCRIPTION).read_text())
    assert "quantization_config" not in config, "vLLM would insist on the config's method, not --quantization ascend"
    dtype = getattr(torch, config["torch_dtype"])
    tensors = {}
    for file in export_dir.glob("*.safetensors"):
        with safe_open(file, "pt") as handle:
            tensors |= {name: handle.get_tensor(name) for name in handle.keys()}
    if config.get("tie_word_embeddings"):
        assert not any(name.startswith("lm_head.") for name in tensors)  # the tied loader skips them

    methods, params = {}, {}
    for kind, path, prefix in vllm_modules(config):
        methods[path] = method = quant_method(description, kind, prefix)
        if method == "W8A8_DYNAMIC":
            assert dtype == torch.bfloat16, f"{path}: W8A8_DYNAMIC runs only in bfloat16 models"
        proj = path.split(".")[-1]
        for shard in (path.replace(proj, s) for s in PACKED.get(proj, (proj,))):
            weight = "model.embed_tokens.weight" if path == "lm_head" and config.get("tie_word_embeddings") else f"{shard}.weight"
            if kind == "norm":
                params[weight] = (dtype, source_shapes[weight])
                continue
            n, k = source_shapes[weight]
            params |= {f"{shard}.{name}": spec for name, spec in declared(method, dtype, n, k).items()}
    if config.get("tie_word_embeddings"):
        params = {name: spec for name, spec in params.items() if not name.startswith("lm_head.")}  # tied to embed_tokens

    assert set(tensors) == set(params), f"unexpected {sorted(set(tensors) - set(params))}, missing {sorted(set(params) - set(tensors))}"
    for name, (want_dtype, want_shape) in params.items():
        got = tensors[name]
        assert tuple(got.shape) == want_shape, f"{name}: {tuple(got.shape)} != {want_shape}"
        if want_dtype in INTS:  # copied in with copy_: the values must survive the cast (an int64 deq_scale's bits would not)
            assert torch.equal(got.to(want_dtype).to(got.dtype), got), f"{name}: {got.dtype} does not load into {want_dtype}"
        else:
            assert got.is_floating_point(), f"{name}: {got.dtype} for {want_dtype}"
    return methods


FAMILIES = [(arch, tied, dtype) for arch in ("qwen3", "llama") for tied in (False, True) for dtype in ("bfloat16", "float16")]


@pytest.fixture(scope="module", params=FAMILIES, ids=[f"{a}-{'tied' if t else 'untied'}-{d}" for a, t, d in FAMILIES])
def family_export(request, tmp_path_factory):
    arch, tied, dtype = request.param
    root = tmp_path_factory.mktemp(f"{arch}-{tied}-{dtype}")
    model = save_tiny(root / "model", arch, seed=5, dtype=getattr(torch, dtype), num_hidden_layers=2, tie_word_embeddings=tied)
    files = quasar_deploy.calibrate(model, output=root / "w8a8", **FAST_CALIBRATION)
    with safe_open(next(model.glob("*.safetensors")), "pt") as handle:
        shapes = {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}
    return files, export(files.path, "npu", root / "npu", progress=False), shapes


def test_the_rules_are_read_at_the_pinned_tag():
    """The base's tag is a build argument (A2 by default; A3's is the same release, its loader the same)."""
    text = NPU_DOCKERFILE.read_text()
    tag = re.search(r"^FROM quay\.io/ascend/vllm-ascend:(\S+)", text, re.M).group(1)
    tag = re.sub(r"\$\{(\w+)\}", lambda arg: re.search(rf"^ARG {arg.group(1)}=(\S+)", text, re.M).group(1), tag)
    assert tag == PINNED_TAG, f"docker/npu pins {tag}: read vLLM-Ascend's loader at that tag and update this test"


def test_every_family_loads_by_the_loaders_rules(family_export):
    files, out, shapes = family_export
    methods = load_as_vllm_ascend(out, shapes)
    quantized = set(files.manifest["quantized_layers"])
    for path, method in methods.items():
        proj = path.split(".")[-1]
        shards = {path.replace(proj, s) for s in PACKED.get(proj, (proj,))}
        assert method == ("W8A8_DYNAMIC" if shards <= quantized else "FLOAT"), path
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"  # also from float16 sources


def test_tied_models_describe_the_head_they_do_not_store(family_export):
    _, out, _ = family_export
    config = json.loads((out / "config.json").read_text())
    description = json.loads((out / DESCRIPTION).read_text())
    if not config.get("tie_word_embeddings"):
        pytest.skip("an untied head is a tensor like the others")
    assert description["lm_head.weight"] == "FLOAT"  # with no such tensor (load_as_vllm_ascend checks)


@pytest.mark.parametrize(
    "key, value, error",
    [
        ("model.layers.0.self_attn.k_proj.weight", None, KeyError),  # a packed shard is looked up directly
        ("model.layers.1.mlp.up_proj.weight", "FLOAT", ValueError),  # half of gate_up_proj float
        ("model.embed_tokens.weight", "W8A8_DYNAMIC", AssertionError),  # a quantized embedding (Qwen3's prefix)
    ],
    ids=["missing-shard", "split-pack", "quantized-embedding"],
)
def test_the_rules_refuse_what_the_loader_refuses(family_export, tmp_path, key, value, error):
    """The encoded rules fail where the loader fails, so the passing cases above mean something."""
    _, out, shapes = family_export
    if key.startswith("model.embed_tokens") and json.loads((out / "config.json").read_text())["model_type"] == "llama":
        pytest.skip("Llama's embedding is asked about under the prefix '', never by its tensor name")
    broken = tmp_path / "broken"
    broken.mkdir()
    for file in out.iterdir():
        (broken / file.name).write_bytes(file.read_bytes())
    description = json.loads((out / DESCRIPTION).read_text())
    if value is None:
        del description[key]
    else:
        description[key] = value
    (broken / DESCRIPTION).write_text(json.dumps(description))
    with pytest.raises(error):
        load_as_vllm_ascend(broken, shapes)


def test_float16_is_refused_for_dynamic_artifacts(family_export, tmp_path):
    files, _, _ = family_export
    with pytest.raises(QuasarError, match="applies to static artifacts only"):
        export(files.path, "npu", tmp_path / "npu", dtype="float16")
    assert not (tmp_path / "npu").exists()


def test_static_float16_export_loads(tiny_static_artifact, tiny_qwen3, tmp_path):
    out = export(tiny_static_artifact.path, "npu", tmp_path / "npu", dtype="float16", progress=False)
    with safe_open(tiny_qwen3 / "model.safetensors", "pt") as handle:
        shapes = {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}
    assert set(load_as_vllm_ascend(out, shapes).values()) == {"FLOAT", "W8A8"}
