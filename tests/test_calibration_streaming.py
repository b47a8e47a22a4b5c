"""Layer-streaming calibration equals the whole-model calibration it replaced, bit for bit.

``whole_model_calibration`` is that earlier path, kept here as the reference: the float32
decoder loaded whole, one pass over the calibration set with forward pre-hooks on every
group's input (one sampling generator, drawn per sample, layer and group), then alpha
search and folding group by group, then quantization.
"""

import json
import shutil
import struct

import pytest
import torch
from safetensors import safe_open

from quasar_deploy import QuasarError, calibrate
from quasar_deploy.artifact import open_model_files
from quasar_deploy.calibration import CalibrationRecipe, data, smoothing
from quasar_deploy.checkpoint import Checkpoint
from quasar_deploy.exporters import export
from quasar_deploy.scheme import QMAX, quantize_weight
from quasar_deploy.shards import INDEX
from quasar_deploy.tokenizer import load_tokenizer

from .tiny import save_tiny

ROWS = 256


@torch.no_grad()
def whole_model_calibration(model_dir, recipe: CalibrationRecipe) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """The manifest's groups and the artifact's tensors as the whole-model path produced them."""
    source = open_model_files(model_dir)
    samples = data.calibration_samples(load_tokenizer(source, False), recipe.calib_data, recipe.num_samples, recipe.seq_len)
    decoder = source.decoder(torch.float32)
    decoder.prepare("torch", "reference")
    modules = dict(decoder.named_modules())
    groups = source.spec.smooth_groups()
    per_sample = max(1, -(-ROWS // len(samples)))
    generator = torch.Generator().manual_seed(0)
    absmax, rows = {}, {g.name: [] for g in groups}

    def hook_for(name):
        def hook(_module, args):
            x = args[0].reshape(-1, args[0].shape[-1]).float()
            m = x.abs().amax(dim=0)
            absmax[name] = m if name not in absmax else torch.maximum(absmax[name], m)
            rows[name].append(x[torch.randperm(x.shape[0], generator=generator)[:per_sample]].clone())

        return hook

    handles = [modules[g.linears[0]].register_forward_pre_hook(hook_for(g.name)) for g in groups]
    for ids in samples:
        decoder(torch.tensor(ids, dtype=torch.long), decoder.new_cache(len(ids)))
    for handle in handles:
        handle.remove()
    static = recipe.activation == "static"
    records, input_absmax = [], {}
    for group in groups:
        weights = {n: modules[n].weight.data.float() for n in group.linears}
        sampled = torch.cat(rows[group.name])[:ROWS]
        result = smoothing.search(sampled, absmax[group.name], weights, recipe.alpha, static, group.source is not None)
        if result.scales is not None:
            smoothing.fold(modules[group.source], [modules[n] for n in group.linears], result.scales)
        for name in group.linears:
            input_absmax[name] = absmax[group.name] if result.scales is None else absmax[group.name] / result.scales
        records.append(dict(name=group.name, alpha=result.alpha, error_before=result.error_before, error_after=result.error_after))
    for name, linear in decoder.linears():
        wq, w_scale = quantize_weight(linear.weight.data)
        linear.set_quantized(wq, w_scale, (input_absmax[name].max().clamp(min=1e-12) / QMAX).reshape(1) if static else None)
    dtype = getattr(torch, source.checkpoint.config.get("torch_dtype") or source.checkpoint.config.get("dtype") or "float32")
    tensors = {}
    for name, tensor in decoder.state_dict().items():
        if name == "lm_head.weight" and source.spec.tie_word_embeddings:
            continue
        keep = tensor.dtype == torch.int8 or name.endswith(("weight_scale", "input_scale"))
        tensors[name] = tensor if keep else tensor.to(dtype)
    return records, tensors


def artifact_tensors(path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(file, "pt") as handle:
            tensors |= {name: handle.get_tensor(name) for name in handle.keys()}
    return tensors


def assert_same_as_whole_model(model_dir, artifact, recipe: CalibrationRecipe) -> None:
    records, expected = whole_model_calibration(model_dir, recipe)
    groups = [{k: g[k] for k in ("name", "alpha", "error_before", "error_after")} for g in artifact.manifest["groups"]]
    assert groups == records
    got = artifact_tensors(artifact.path)
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


@pytest.mark.parametrize("model,activation", [("tiny_qwen3", "dynamic"), ("tiny_llama", "static")])
def test_streaming_equals_whole_model(model, activation, request, tmp_path):
    recipe = CalibrationRecipe(num_samples=6, seq_len=48, activation=activation)
    model_dir = request.getfixturevalue(model)
    artifact = calibrate(model_dir, tmp_path / "out", recipe=recipe, progress=False)
    assert_same_as_whole_model(model_dir, artifact, recipe)
    assert json.loads((artifact.path / "quasar.json").read_text())["recipe"]["alpha"] == "auto"


def _data_bytes(shard) -> int:
    with open(shard, "rb") as handle:
        return shard.stat().st_size - 8 - struct.unpack("<Q", handle.read(8))[0]


@pytest.fixture(scope="module")
def bf16_in_3_shards(tmp_path_factory):
    path = save_tiny(tmp_path_factory.mktemp("bf16") / "m", "llama", seed=2, dtype=torch.bfloat16, max_shard_size="300KB")
    assert len(list(path.glob("*.safetensors"))) == 3 and (path / INDEX).is_file()
    return path


def test_bf16_input_in_3_shards_gives_bf16_floats_and_equals_whole_model(bf16_in_3_shards, tmp_path):
    recipe = CalibrationRecipe(num_samples=4, seq_len=32)
    artifact = calibrate(bf16_in_3_shards, tmp_path / "out", recipe=recipe, progress=False)
    assert_same_as_whole_model(bf16_in_3_shards, artifact, recipe)
    tensors = artifact_tensors(artifact.path)
    assert {tensors[n].dtype for n in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight")} == {torch.bfloat16}
    assert tensors["model.layers.0.input_layernorm.weight"].dtype == torch.bfloat16


@pytest.mark.parametrize("dtype,tied", [(torch.float16, True), (torch.float32, False)])
def test_one_file_inputs_fp16_tied_and_fp32_untied(dtype, tied, tmp_path):
    model = save_tiny(tmp_path / "m", "qwen3", seed=3, dtype=dtype, tie_word_embeddings=tied)
    recipe = CalibrationRecipe(num_samples=4, seq_len=32, keep_float=("*.1.mlp.down_proj",))
    artifact = calibrate(model, tmp_path / "out", recipe=recipe, progress=False)
    assert ("lm_head.weight" in artifact_tensors(artifact.path)) is not tied
    assert artifact_tensors(artifact.path)["model.layers.1.mlp.down_proj.weight"].dtype == dtype
    records, _ = whole_model_calibration(model, recipe)  # the reference knows no keep-float: it searches that group too
    searched = [(g["name"], g["alpha"]) for g in artifact.manifest["groups"] if g["name"] != "model.layers.1.down"]
    assert searched == [(r["name"], r["alpha"]) for r in records if r["name"] != "model.layers.1.down"]


def test_shards_without_their_index_still_load(bf16_in_3_shards, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(bf16_in_3_shards, copy)
    (copy / INDEX).unlink()
    assert Checkpoint(copy).names == Checkpoint(bf16_in_3_shards).names


def test_a_shard_the_index_does_not_list_is_refused(bf16_in_3_shards, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(bf16_in_3_shards, copy)
    shutil.copy(copy / "model-00001-of-00003.safetensors", copy / "model-00004-of-00003.safetensors")
    with pytest.raises(QuasarError, match=r"model-00004-of-00003.safetensors: not listed in model.safetensors.index.json; remove it"):
        Checkpoint(copy)


def test_sharded_artifact_loads_here_and_in_compressed_tensors(tiny_qwen3, tmp_path):
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.utils.safetensors_load import get_safetensors_header, get_weight_mappings

    recipe = CalibrationRecipe(num_samples=4, seq_len=32, activation="static")
    artifact = calibrate(tiny_qwen3, tmp_path / "out", recipe=recipe, progress=False, max_shard_size=400_000)
    shards = sorted(p.name for p in artifact.path.glob("*.safetensors"))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert set(shards) | {INDEX} <= set(artifact.manifest["files"])
    index = json.loads((artifact.path / INDEX).read_text())
    assert set(index["weight_map"].values()) == set(shards)
    for shard in shards:  # within the limit, or one tensor alone that exceeds it (the embeddings), as Hugging Face shards
        assert _data_bytes(artifact.path / shard) <= 400_000 or len(get_safetensors_header(artifact.path / shard)) == 2
    assert_same_as_whole_model(tiny_qwen3, artifact, recipe)
    config = json.loads((artifact.path / "config.json").read_text())
    assert QuantizationConfig.model_validate(config["quantization_config"]).format == "int-quantized"
    mapping = get_weight_mappings(str(artifact.path))
    assert set(mapping) == set(index["weight_map"])
    name = "model.layers.2.mlp.down_proj"
    with safe_open(mapping[f"{name}.weight"], "pt") as handle:
        assert handle.get_tensor(f"{name}.weight").dtype == torch.int8
    decoder = open_model_files(artifact.path).decoder()
    assert decoder.model.layers[2].mlp.down_proj.quantized and decoder.model.layers[2].mlp.down_proj.input_scale is not None
    for target in ("npu", "onnx"):  # both exporters read a sharded artifact
        assert (export(artifact.path, target, tmp_path / target) / "config.json").is_file()


def test_device_that_is_not_available_is_refused_in_one_line(tiny_qwen3, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(QuasarError, match=r"^--device cuda: no CUDA device visible to torch \(.*\)$"):
        calibrate(tiny_qwen3, tmp_path / "out", num_samples=2, seq_len=16, progress=False, device="cuda")
    with pytest.raises(QuasarError, match=r"^--device must be one of cpu, cuda, npu, not 'tpu'$"):
        calibrate(tiny_qwen3, tmp_path / "out", num_samples=2, seq_len=16, progress=False, device="tpu")
    assert not (tmp_path / "out").exists()


def test_one_shard_is_byte_for_byte_what_save_file_writes(tmp_path):
    from safetensors.torch import save_file

    from quasar_deploy.shards import ShardWriter

    tensors = {"z": torch.arange(5, dtype=torch.int8), "b": torch.ones(2, 3), "a": torch.full((3,), 2.5, dtype=torch.bfloat16)}
    (tmp_path / "ours").mkdir()
    writer = ShardWriter(tmp_path / "ours")
    for name, tensor in tensors.items():
        writer.add(name, tensor)
    writer.close()
    save_file(tensors, str(tmp_path / "theirs.safetensors"), metadata={"format": "pt"})
    assert (tmp_path / "ours" / "model.safetensors").read_bytes() == (tmp_path / "theirs.safetensors").read_bytes()
