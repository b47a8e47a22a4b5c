"""The NPU backend, run on CPU through the torch_npu emulation (tests/npu_emulation.py).

What this proves without an NPU: the backend calls the ops with the right layouts, scales and
dtypes, the integer parts (int8 activations, int32 accumulation) equal the reference numerics
exactly, the outputs agree to float rounding, and greedy decoding matches the reference backend.
What it cannot prove: that real torch_npu kernels behave as their documentation (and so the
emulation) says. docs/npu.md has the script for an Ascend machine.
"""

from __future__ import annotations

import sys
from types import ModuleType, SimpleNamespace

import pytest
import torch

import quasar_deploy
from quasar_deploy.backends import npu as npu_backend
from quasar_deploy.backends.torch_backend import TorchCausalLM
from quasar_deploy.errors import QuasarError
from quasar_deploy.scheme import int8_matmul_int32, per_token_scale, quantize_activation, quantize_weight, reference_linear

from . import npu_emulation
from .helpers import greedy

PROMPT = [11, 402, 7, 93, 1500, 64, 2048, 5, 77]


@pytest.fixture
def fake_torch_npu(monkeypatch) -> ModuleType:
    monkeypatch.setitem(sys.modules, "torch_npu", npu_emulation)
    return npu_emulation


@pytest.fixture(params=["dynamic", "static", "int8-head"])
def artifact(request):
    names = {"dynamic": "tiny_artifact", "static": "tiny_static_artifact", "int8-head": "tiny_int8_head_artifact"}
    return request.getfixturevalue(names[request.param])


def reference_lm(files) -> TorchCausalLM:
    decoder = files.decoder(torch.bfloat16)
    decoder.prepare("torch", "reference")
    return TorchCausalLM(decoder)


def test_dynamic_quant_integers_equal_the_scheme():
    x = torch.randn(7, 96).to(torch.bfloat16) * 3
    q, scale = npu_emulation.npu_dynamic_quant(x)
    expected_scale = per_token_scale(x)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (7,)
    assert torch.equal(scale, expected_scale.reshape(-1))
    assert torch.equal(q.float(), quantize_activation(x, expected_scale))


def test_static_quantize_with_clamp_equals_the_scheme():
    """Activations past the calibrated range saturate to -127 as in the scheme, not the op's -128."""
    x = torch.randn(5, 64).to(torch.bfloat16)
    scale = torch.tensor([0.004])
    q = npu_emulation.npu_quantize(x, scale.expand(64).contiguous(), None, torch.qint8, -1, True)
    assert q.min() == -128
    assert torch.equal(q.clamp(-127, 127).float(), quantize_activation(x, scale.reshape(1, 1)))


@pytest.mark.parametrize("activation", ["dynamic", "static"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_matches_reference_linear(activation, dtype):
    torch.manual_seed(0)
    x = (torch.randn(6, 80) * 2).to(dtype)
    wq, w_scale = quantize_weight(torch.randn(48, 80) * 0.05)
    bias = torch.randn(48) * 0.1
    input_scale = (x.float().abs().amax() / 127 * 0.8).reshape(1) if activation == "static" else None
    got = npu_backend.npu_int8_linear(npu_emulation, wq, w_scale, bias, input_scale)(x)
    act_scale = per_token_scale(x) if input_scale is None else input_scale.reshape(1, 1)
    acc = int8_matmul_int32(quantize_activation(x, act_scale), wq)
    assert acc.abs().max() < 2**24  # float32 holds every accumulator exactly: differences below are float rounding only
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), reference_linear(x, wq, w_scale, bias, input_scale).float(), rtol=2**-7, atol=1e-3)


def test_backend_logits_and_greedy_match_the_reference(artifact, fake_torch_npu):
    files = quasar_deploy.artifact.open_model_files(artifact.path)
    lm = npu_backend.load_npu(files, dtype="bfloat16", device="cpu")
    ref = reference_lm(files)
    assert "npu W8A8" in lm.description
    quantized = [m for _, m in lm.decoder.linears() if m.quantized]
    assert quantized and all(m.weight.is_meta for m in quantized)
    torch.testing.assert_close(lm.prefill(PROMPT), ref.prefill(PROMPT), rtol=2**-7, atol=2**-9)  # one bfloat16 step
    assert greedy(lm, PROMPT, 20) == greedy(ref, PROMPT, 20)


def test_rollback_then_verify_matches_fresh_decode(artifact, fake_torch_npu):
    lm = npu_backend.load_npu(artifact, device="cpu")
    first = greedy(lm, PROMPT, 6)
    lm.truncate(len(PROMPT) + 2)
    again = lm.verify(first[2:5]).argmax(-1).tolist()
    assert again == first[3:6]


def test_bad_dtype_is_one_line(artifact, fake_torch_npu):
    with pytest.raises(QuasarError, match="bfloat16, float16"):
        npu_backend.load_npu(artifact, dtype="float32", device="cpu")


def test_unavailable_without_torch_npu(monkeypatch):
    monkeypatch.setattr(npu_backend.importlib.util, "find_spec", lambda name: None)
    imported = []
    monkeypatch.setattr(npu_backend.importlib, "import_module", lambda name: imported.append(name))
    assert npu_backend.unavailable().startswith("torch_npu not installed")
    assert imported == []


def test_unavailable_when_torch_npu_breaks_on_import(monkeypatch, tmp_path):
    monkeypatch.setattr(npu_backend.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setenv("ASCEND_HOME_PATH", str(tmp_path))

    def broken(name):
        raise ImportError("libhccl.so: cannot open shared object file: No such file or directory")

    monkeypatch.setattr(npu_backend.importlib, "import_module", broken)
    assert npu_backend.unavailable() == "torch_npu does not import (libhccl.so: cannot open shared object file: No such file or directory)"


def test_unavailable_without_cann(monkeypatch, tmp_path):
    monkeypatch.setattr(npu_backend.importlib.util, "find_spec", lambda name: object())
    for name in npu_backend.CANN_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(npu_backend, "CANN_DEFAULT", tmp_path / "absent")
    imported = []
    monkeypatch.setattr(npu_backend.importlib, "import_module", lambda name: imported.append(name))
    assert npu_backend.unavailable().startswith("CANN not found")
    assert imported == []


def test_unavailable_without_device(monkeypatch, tmp_path):
    monkeypatch.setattr(npu_backend.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setenv("ASCEND_HOME_PATH", str(tmp_path))
    no_device = SimpleNamespace(npu=SimpleNamespace(is_available=lambda: False, device_count=lambda: 0))
    monkeypatch.setattr(npu_backend.importlib, "import_module", lambda name: no_device)
    assert npu_backend.unavailable().startswith("no NPU device")


def test_registered_and_refused_here(tiny_qwen3):
    from quasar_deploy.backends import BACKENDS, create_backend

    assert "npu" in BACKENDS
    reason = npu_backend.unavailable()
    if reason is not None:
        with pytest.raises(QuasarError, match="backend 'npu' cannot run here") as info:
            create_backend("npu", quasar_deploy.artifact.open_model_files(tiny_qwen3))
        assert str(info.value) == f"backend 'npu' cannot run here: {reason}"


def test_the_registry_builds_the_npu_backend_where_it_can_run(tiny_artifact, fake_torch_npu, monkeypatch):
    """``create_backend("npu", ...)`` is ``load_npu``: same description, same logits."""
    from quasar_deploy.backends import create_backend

    monkeypatch.setattr(npu_backend, "unavailable", lambda: None)
    lm = create_backend("npu", tiny_artifact, device="cpu")
    direct = npu_backend.load_npu(tiny_artifact, device="cpu")
    assert lm.description == direct.description and "npu W8A8" in lm.description
    assert torch.equal(lm.prefill(PROMPT), direct.prefill(PROMPT))
