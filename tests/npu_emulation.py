"""CPU EMULATION of the few ``torch_npu`` ops quasar-deploy's NPU backend calls. Not torch_npu, not fast.

Why it exists: no Ascend NPU is available in CI, yet the NPU backend's code path (weight
layout, which op gets which scale, dtypes, the static-scale clamp) must run somewhere. Each
function here implements the semantics the Ascend documentation gives for the op (sources in
``docs/npu.md``): shapes, dtypes, rounding, saturation and scale conventions. Tests inject this
module as a fake ``torch_npu`` (``sys.modules["torch_npu"]``), so the backend runs unchanged.

Assumptions the docs do not pin down, and an Ascend machine must confirm:
- float -> int8 conversions round half to even and saturate to [-128, 127];
- quantize steps compute in float32 whatever the input dtype;
- the int64 ``scale`` of ``npu_quant_matmul`` keeps 19 bits of the float32 pattern (as the
  op-plugin unit test of ``npu_trans_quant_param`` models it).

Only the arguments the backend and the vLLM-Ascend round-trip test use are accepted; anything
else raises, so a call this emulation does not model cannot pass silently.
"""

from __future__ import annotations

import torch

ACL_FORMAT_ND = 2
ACL_FORMAT_FRACTAL_NZ = 29
_HARDWARE_SCALE_MASK = 0xFFFFE000  # 1 sign + 8 exponent + 10 mantissa bits of a float32


def _to_int8(values: torch.Tensor) -> torch.Tensor:
    """Float -> int8 as the hardware casts: round half to even, saturate to [-128, 127]."""
    return torch.round(values).clamp(-128, 127).to(torch.int8)


def npu_format_cast(tensor: torch.Tensor, acl_format: int) -> torch.Tensor:
    """FRACTAL_NZ is an internal tiling of the same logical matrix: values and shape are unchanged."""
    if acl_format not in (ACL_FORMAT_ND, ACL_FORMAT_FRACTAL_NZ):
        raise ValueError(f"emulated npu_format_cast knows ND (2) and FRACTAL_NZ (29), not {acl_format}")
    return tensor


def npu_dynamic_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token symmetric int8: ``scale = rowmax|x| / 127`` (float32, x's shape minus the last dim), ``y = round(x / scale)``."""
    if x.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"npu_dynamic_quant takes float16 or bfloat16 input, not {x.dtype}")
    if x.dim() < 2:
        raise ValueError("npu_dynamic_quant needs an input of at least 2 dimensions")
    xf = x.float()
    scale = xf.abs().amax(dim=-1) / 127.0
    return _to_int8(xf / scale.unsqueeze(-1)), scale


def npu_quantize(
    input: torch.Tensor,
    scales: torch.Tensor,
    zero_points: torch.Tensor | None,
    dtype: torch.dtype,
    axis: int = 1,
    div_mode: bool = True,
) -> torch.Tensor:
    """``y = input / scales + zero_points`` (div_mode) or ``input * scales + zero_points``, saturated to int8 along the last axis."""
    if dtype != torch.qint8:
        raise ValueError(f"emulated npu_quantize produces torch.qint8 only, not {dtype}")
    if axis not in (-1, input.dim() - 1):
        raise ValueError("npu_quantize applies its scales along the last axis only")
    if scales.numel() not in (1, input.shape[-1]):
        raise ValueError(f"scales of {scales.numel()} elements do not fit an input with {input.shape[-1]} columns")
    xf = input.float()
    values = xf / scales.float() if div_mode else xf * scales.float()
    if zero_points is not None:
        values = values + zero_points.float()
    return _to_int8(values)


def decode_int64_scale(scale: torch.Tensor) -> torch.Tensor:
    """The float32 an int64 ``npu_quant_matmul`` scale carries: its low 32 bits, cut to the hardware's 19 bits."""
    bits = (scale & _HARDWARE_SCALE_MASK).to(torch.int32)
    return bits.view(torch.float32)


def npu_quant_matmul(
    x1: torch.Tensor,
    x2: torch.Tensor,
    scale: torch.Tensor,
    *,
    pertoken_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    output_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """int8 [m, k] @ int8 [k, n] with int32 accumulation, then dequantized.

    Per the op's table: int32 ``bias`` joins the accumulator, ``(acc + bias) * scale``;
    with ``pertoken_scale`` [m] (float32) the result is ``acc * scale * pertoken_scale``;
    a float ``bias`` is added after dequantization. ``scale`` is [n] or [1]: float32,
    bfloat16, or int64 (``npu_trans_quant_param`` / msModelSlim encoding).
    """
    if x1.dtype != torch.int8 or x2.dtype != torch.int8:
        raise TypeError(f"npu_quant_matmul takes int8 x1 and x2, not {x1.dtype} and {x2.dtype}")
    if x1.dim() != 2 or x2.dim() != 2 or x1.shape[1] != x2.shape[0]:
        raise ValueError(f"npu_quant_matmul: shapes {tuple(x1.shape)} and {tuple(x2.shape)} do not multiply (x2 is [k, n])")
    if output_dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"emulated npu_quant_matmul outputs float16 or bfloat16, not {output_dtype}")
    n = x2.shape[1]
    if scale.dim() != 1 or scale.numel() not in (1, n):
        raise ValueError(f"scale must be 1-D with 1 or {n} elements, not shape {tuple(scale.shape)}")
    if output_dtype == torch.float16 and pertoken_scale is not None and scale.dtype != torch.float32:
        raise TypeError("float16 output with pertoken_scale takes a float32 scale")
    acc = x1.to(torch.int32) @ x2.to(torch.int32)
    if bias is not None and bias.dtype == torch.int32:
        acc = acc + bias
    scale_f = decode_int64_scale(scale) if scale.dtype == torch.int64 else scale.float()
    y = acc.float() * scale_f
    if pertoken_scale is not None:
        if pertoken_scale.dtype != torch.float32 or pertoken_scale.shape != (x1.shape[0],):
            raise ValueError(f"pertoken_scale must be float32 of shape ({x1.shape[0]},)")
        y = y * pertoken_scale.unsqueeze(1)
    if bias is not None and bias.dtype != torch.int32:
        y = y + bias.float()
    return y.to(output_dtype)
