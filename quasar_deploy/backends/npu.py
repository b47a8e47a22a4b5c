"""The Ascend NPU backend: our torch decoder on an ``npu`` device, its W8A8 linears run by torch_npu's int8 ops.

Every torch_npu call lives here (importing it without CANN breaks ``import torch``). A quantized ``Linear`` runs
``npu_dynamic_quant`` (or ``npu_quantize`` clamped to +-127, static) and ``npu_quant_matmul`` on the weight cast once
to FRACTAL_NZ: ``scheme.py``'s scheme with integer-exact int32 sums. The rest of the decoder stays PyTorch code.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from pathlib import Path
from types import ModuleType

import torch

from ..artifact import ModelFiles
from ..cpu.linears import float_linear
from ..errors import QuasarError
from ..files import first_line
from ..model import Decoder, Linear, LinearFn
from ..scheme import QMAX
from .torch_backend import TorchCausalLM

ACL_FORMAT_FRACTAL_NZ = 29
CANN_ENV = ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME")
CANN_DEFAULT = Path("/usr/local/Ascend/ascend-toolkit/latest")
COMPUTE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def _cann_home() -> Path | None:
    """Where CANN is: ``set_env.sh`` exports ASCEND_HOME_PATH / ASCEND_TOOLKIT_HOME; else the default install."""
    for name in CANN_ENV:
        value = os.environ.get(name)
        if value and Path(value).is_dir():
            return Path(value)
    return CANN_DEFAULT if CANN_DEFAULT.is_dir() else None


def unavailable() -> str | None:
    """Why the NPU backend cannot run here, in one line; never imports torch_npu unless it and CANN are present."""
    if importlib.util.find_spec("torch_npu") is None:
        return "torch_npu not installed (pip install 'quasar-deploy[npu]' on an Ascend machine with CANN)"
    if _cann_home() is None:
        return "CANN not found (install the Ascend CANN toolkit and source its set_env.sh)"
    try:
        torch_npu = importlib.import_module("torch_npu")
    except (ImportError, OSError) as exc:
        return f"torch_npu does not import ({first_line(exc)})"
    if not torch_npu.npu.is_available() or torch_npu.npu.device_count() == 0:
        return "no NPU device (torch_npu sees none; check the driver and ASCEND_RT_VISIBLE_DEVICES)"
    return None


def torch_npu_module() -> ModuleType:
    """The torch_npu module (tests put a CPU emulation in ``sys.modules`` under that name)."""
    try:
        return importlib.import_module("torch_npu")
    except (ImportError, OSError) as exc:
        raise QuasarError(f"torch_npu cannot be imported: {first_line(exc)}") from None


def npu_int8_linear(
    npu: ModuleType, wq: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None, input_scale: torch.Tensor | None
) -> LinearFn:
    """The scheme's W8A8 linear on a 2-D float16/bfloat16 input, with torch_npu's ops; tensors already on the device."""
    weight = npu.npu_format_cast(wq.t().contiguous(), ACL_FORMAT_FRACTAL_NZ)
    scale = w_scale.float().reshape(-1).contiguous()
    bias32 = bias.float().contiguous() if bias is not None else None
    if input_scale is None:

        def dynamic(x: torch.Tensor) -> torch.Tensor:
            xq, token_scale = npu.npu_dynamic_quant(x)
            return npu.npu_quant_matmul(xq, weight, scale, pertoken_scale=token_scale, bias=bias32, output_dtype=x.dtype)

        return dynamic

    static_scale = input_scale.float().reshape(1)
    column_scales = static_scale.expand(wq.shape[1]).contiguous()

    def static(x: torch.Tensor) -> torch.Tensor:
        xq = npu.npu_quantize(x, column_scales, None, torch.qint8, -1, True).clamp_(-QMAX, QMAX)
        token_scale = static_scale.expand(x.shape[0]).contiguous()
        return npu.npu_quant_matmul(xq, weight, scale, pertoken_scale=token_scale, bias=bias32, output_dtype=x.dtype)

    return static


def bind_npu_kernels(decoder: Decoder, device: torch.device | str, npu: ModuleType) -> None:
    """Move ``decoder`` to ``device`` and give each ``Linear`` its kernel (quantized weights reach it once, in NZ layout)."""
    for module in decoder.modules():
        if isinstance(module, Linear) and module.quantized:
            module.bind(npu_int8_linear(npu, *(None if t is None else t.to(device) for t in module.tensors())))
            module.release_weight()
    decoder.move_to(device)
    for module in decoder.modules():
        if isinstance(module, Linear) and not module.quantized:
            weight, _, bias, _ = module.tensors()  # in the compute dtype (a head or tied table may be stored narrower)
            module.bind(float_linear(weight, bias, "torch"))


def load_npu(files: ModelFiles, dtype: str = "bfloat16", device: str = "npu:0", max_length: int | None = None) -> TorchCausalLM:
    """W8A8 artifact (or float checkpoint) on an Ascend NPU, computing in ``dtype`` (bfloat16 or float16)."""
    if dtype not in COMPUTE_DTYPES:
        raise QuasarError(f"NPU compute dtype must be one of {', '.join(COMPUTE_DTYPES)}, not {dtype!r}")
    npu = torch_npu_module()
    decoder = files.decoder(COMPUTE_DTYPES[dtype])
    bind_npu_kernels(decoder, device, npu)
    kind = "W8A8" if files.is_artifact else "float"
    scheme = f", {files.scheme.activation} activations" if files.is_artifact else ""
    return TorchCausalLM(decoder, max_length, description=f"npu {kind} ({dtype}{scheme}; npu_quant_matmul, NZ weights)")
