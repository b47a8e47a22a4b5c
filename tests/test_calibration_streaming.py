"""Layer-streaming calibration equals the whole-model calibration it replaced, bit for bit.

``whole_model_calibration`` is that earlier path, kept here as the reference: the float32
decoder loaded whole, one pass over the calibration set with forward pre-hooks on every
group's input (one sampling generator, drawn per sample, layer and group), then alpha
search and folding group by group, then quantization.
"""

import json

import pytest
import torch
from safetensors import safe_open

from quasar_deploy import calibrate
from quasar_deploy.artifact import open_model_files
from quasar_deploy.calibration import CalibrationRecipe, data, smoothing
from quasar_deploy.scheme import QMAX, quantize_weight
from quasar_deploy.tokenizer import load_tokenizer

ROWS = 256


@torch.no_grad()
def whole_model_calibration(model_dir, recipe: CalibrationRecipe) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """The manifest's groups and the artifact's tensors as the whole-model path produced them."""
    source = open_model_files(model_dir)
    samples = data.calibration_samples(load_tokenizer(source.path, False), recipe.calib_data, recipe.num_samples, recipe.seq_len)
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
