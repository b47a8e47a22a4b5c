"""The npu export (msModelSlim AscendV1 layout), read back the way vLLM-Ascend reads it.

Checks names, dtypes and shapes against vLLM-Ascend's parameter declarations, the description
types, that the stored numbers are the artifact's, and that vLLM-Ascend's per-layer math (its
``apply`` for W8A8_DYNAMIC and W8A8, run on the torch_npu emulation) reproduces the artifact's
reference linear from the exported tensors alone.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

import quasar_deploy
from quasar_deploy.artifact import open_model_files
from quasar_deploy.errors import QuasarError
from quasar_deploy.exporters import export
from quasar_deploy.exporters.npu import DESCRIPTION, WEIGHTS
from quasar_deploy.scheme import reference_linear

from . import npu_emulation

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
CASES = [("dynamic", "bfloat16"), ("static", "bfloat16"), ("static", "float16")]


@pytest.fixture(scope="module")
def artifacts(tiny_qwen2_artifact, tiny_qwen2_static_artifact):
    return {"dynamic": tiny_qwen2_artifact, "static": tiny_qwen2_static_artifact}


@pytest.fixture(scope="module", params=CASES, ids=[f"{a}-{d}" for a, d in CASES])
def exported(request, artifacts, tmp_path_factory):
    activation, dtype = request.param
    files = artifacts[activation]
    out = export(files.path, "npu", tmp_path_factory.mktemp("out") / "npu", dtype=dtype)
    description = json.loads((out / DESCRIPTION).read_text())
    with safe_open(out / WEIGHTS, "pt") as handle:
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    return files, out, activation, DTYPES[dtype], description, tensors


def expected_layout(activation: str, n: int, k: int, dtype: torch.dtype) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """vLLM-Ascend's parameter declarations (w8a8_dynamic.py / w8a8_static.py get_weight, get_perchannel_param, get_pertensor_param)."""
    layout = {"weight": (torch.int8, (n, k)), "weight_scale": (torch.float32, (n, 1)), "weight_offset": (torch.float32, (n, 1))}
    if activation == "static":
        layout["input_scale"] = (dtype, (1,))
        layout["input_offset"] = (dtype, (1,))
        layout["quant_bias"] = (torch.int32, (n,))
        layout["deq_scale"] = (torch.float32 if dtype == torch.bfloat16 else torch.int64, (n,))
    return layout


def test_files_config_and_description(exported):
    files, out, activation, dtype, description, tensors = exported
    quant_type = "W8A8_DYNAMIC" if activation == "dynamic" else "W8A8"
    assert description.pop("model_quant_type") == quant_type and description.pop("version") == "1.0.0"
    assert set(description) == set(tensors)
    config = json.loads((out / "config.json").read_text())
    dtype_name = str(dtype).removeprefix("torch.")
    assert "quantization_config" not in config and config["torch_dtype"] == config.get("dtype", dtype_name) == dtype_name
    assert (out / "tokenizer.json").is_file() and sorted(p.name for p in out.glob("*.safetensors")) == [WEIGHTS]
    quantized = set(files.manifest["quantized_layers"])
    for name, kind in description.items():
        assert kind == (quant_type if name.rsplit(".", 1)[0] in quantized else "FLOAT"), name
    assert description["model.layers.0.input_layernorm.weight"] == "FLOAT"
    assert not any(name.endswith("norm.bias") for name in description)


def test_tensors_reproduce_the_artifact(exported):
    files, _, activation, dtype, _, tensors = exported
    ckpt = files.checkpoint
    for prefix in files.manifest["quantized_layers"]:
        wq = ckpt.tensor(f"{prefix}.weight")
        n, k = wq.shape
        for suffix, (want_dtype, want_shape) in expected_layout(activation, n, k, dtype).items():
            got = tensors[f"{prefix}.{suffix}"]
            assert (got.dtype, tuple(got.shape)) == (want_dtype, want_shape), f"{prefix}.{suffix}"
        w_scale = ckpt.tensor(f"{prefix}.weight_scale").float()
        assert torch.equal(tensors[f"{prefix}.weight"], wq)
        assert torch.equal(tensors[f"{prefix}.weight_scale"], w_scale.reshape(n, 1))
        assert not tensors[f"{prefix}.weight_offset"].any()
        bias = ckpt.tensor(f"{prefix}.bias") if f"{prefix}.bias" in ckpt.names else None
        if bias is not None:
            assert torch.equal(tensors[f"{prefix}.bias"], bias.to(dtype))
        if activation == "static":
            input_scale = tensors[f"{prefix}.input_scale"]
            assert torch.equal(input_scale, ckpt.tensor(f"{prefix}.input_scale").reshape(1).to(dtype))
            assert not tensors[f"{prefix}.input_offset"].any()
            deq = tensors[f"{prefix}.deq_scale"]
            deq = deq.to(torch.int32).view(torch.float32) if deq.dtype == torch.int64 else deq
            assert torch.equal(deq, input_scale.float() * w_scale.reshape(-1))
            expected_bias = torch.zeros(n) if bias is None else torch.round(bias.double() / deq.double())
            assert torch.equal(tensors[f"{prefix}.quant_bias"].double(), expected_bias.double())
    if activation == "static":
        assert any(tensors[f"{prefix}.quant_bias"].any() for prefix in files.manifest["quantized_layers"])
    floats = [name for name in ckpt.names if name.rsplit(".", 1)[0] not in set(files.manifest["quantized_layers"])]
    for name in floats:
        assert torch.equal(tensors[name], ckpt.tensor(name).to(dtype)), name


def vllm_ascend_apply(tensors: dict, prefix: str, activation: str, dtype: torch.dtype, x: torch.Tensor) -> torch.Tensor:
    """vLLM-Ascend's linear math on its loaded parameters (scales cast to the model dtype on load), via the emulated ops."""
    npu = npu_emulation
    weight = tensors[f"{prefix}.weight"].t().contiguous()
    if activation == "dynamic":
        bias = tensors.get(f"{prefix}.bias")
        xq, token_scale = npu.npu_dynamic_quant(x)
        scale = tensors[f"{prefix}.weight_scale"].to(dtype).flatten()
        scale = scale.float() if dtype == torch.float16 else scale
        return npu.npu_quant_matmul(xq, weight, scale, pertoken_scale=token_scale, bias=bias, output_dtype=dtype)
    k = weight.shape[0]
    reciprocal = (1 / tensors[f"{prefix}.input_scale"]).repeat(k)
    offset = tensors[f"{prefix}.input_offset"].to(dtype).repeat(k)
    xq = npu.npu_quantize(x, reciprocal, offset, torch.qint8, -1, False)
    return npu.npu_quant_matmul(xq, weight, tensors[f"{prefix}.deq_scale"], bias=tensors[f"{prefix}.quant_bias"], output_dtype=dtype)


def test_vllm_ascend_math_reproduces_the_reference_linear(exported):
    files, _, activation, dtype, _, tensors = exported
    ckpt = files.checkpoint
    torch.manual_seed(0)
    for prefix in files.manifest["quantized_layers"][:7]:
        wq = ckpt.tensor(f"{prefix}.weight")
        static = ckpt.tensor(f"{prefix}.input_scale") if activation == "static" else None
        bias = ckpt.tensor(f"{prefix}.bias").float() if f"{prefix}.bias" in ckpt.names else None
        limit = float(static) * 127 if static is not None else 1.0
        x = (torch.rand(5, wq.shape[1]) * 2 - 1).mul(limit).to(dtype)
        want = reference_linear(x.float(), wq, ckpt.tensor(f"{prefix}.weight_scale"), bias, static)
        got = vllm_ascend_apply(tensors, prefix, activation, dtype, x).float()
        error = (got - want).norm() / want.norm()
        assert error < 0.02, f"{prefix}: relative error {error:.4f}"


def test_export_refuses_bad_input(artifacts, tiny_qwen2, tmp_path):
    with pytest.raises(QuasarError, match="not a W8A8 artifact"):
        export(tiny_qwen2, "npu", tmp_path / "a")
    with pytest.raises(QuasarError, match="bfloat16, float16"):
        export(artifacts["dynamic"].path, "npu", tmp_path / "b", dtype="float32")
    (tmp_path / "c").mkdir()
    with pytest.raises(QuasarError, match="already exists"):
        export(artifacts["dynamic"].path, "npu", tmp_path / "c")
    assert not list(tmp_path.glob(".tmp-*"))
    assert open_model_files(artifacts["dynamic"].path).is_artifact


def test_cli_export(artifacts, tmp_path):
    from click.testing import CliRunner

    from quasar_deploy.cli import main

    result = CliRunner().invoke(main, ["export", str(artifacts["static"].path), "--target", "npu", "--output", str(tmp_path / "npu")])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "npu" / DESCRIPTION).read_text())["model_quant_type"] == "W8A8"


def test_partly_float_fused_group_is_refused(tiny_qwen2, tmp_path):
    """vLLM-Ascend gives q/k/v (and gate/up) one quant type; an artifact that splits them cannot load there."""
    files = quasar_deploy.calibrate(
        tiny_qwen2, output=tmp_path / "art", num_samples=4, seq_len=32, keep_float=["*.layers.1.self_attn.k_proj"], progress=False
    )
    with pytest.raises(QuasarError, match=r"model.layers.1.self_attn.k_proj differs"):
        export(files.path, "npu", tmp_path / "npu")


def test_wholly_float_group_exports_as_float(tiny_qwen2, tmp_path):
    files = quasar_deploy.calibrate(
        tiny_qwen2,
        output=tmp_path / "art",
        num_samples=4,
        seq_len=32,
        keep_float=["*.layers.0.mlp.gate_proj", "*.layers.0.mlp.up_proj"],
        progress=False,
    )
    description = json.loads((export(files.path, "npu", tmp_path / "npu") / DESCRIPTION).read_text())
    assert description["model.layers.0.mlp.up_proj.weight"] == "FLOAT"
    assert "model.layers.0.mlp.up_proj.weight_scale" not in description
    assert description["model.layers.0.mlp.down_proj.weight"] == "W8A8_DYNAMIC"


def test_sharded_export_holds_the_same_tensors(exported, tmp_path):
    """Above ``max_shard_size`` the weights go to msModelSlim-named shards with an index, tensor for tensor the same."""
    files, _, _, dtype, _, tensors = exported
    out = export(files.path, "npu", tmp_path / "sharded", dtype=str(dtype).removeprefix("torch."), max_shard_size=200_000, progress=False)
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 1 and shards[0] == f"quant_model_weights-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((out / "quant_model_weights.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(tensors) and set(index["weight_map"].values()) == set(shards)
    for shard in shards:
        with safe_open(out / shard, "pt") as handle:
            for name in handle.keys():
                assert index["weight_map"][name] == shard and torch.equal(handle.get_tensor(name), tensors[name]), name
