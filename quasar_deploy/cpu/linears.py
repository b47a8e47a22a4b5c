"""Linear-layer kernels: which arithmetic each one really computes, and the float dtype they compute in.

Int8 kernels all compute the W8A8 scheme of ``scheme.py`` with integer-exact accumulation; they differ in speed:

- ``reference``: plain PyTorch, float64 accumulation of integer values. The oracle.
- ``fbgemm``: FBGEMM's u8 x s8 dynamic linear, whose AVX2 kernel sums u8*s8 pairs in saturating 16-bit lanes. Each
  int8 row ``q`` is split as ``q = 2*a + b`` (``a`` in [-64, 63], ``b`` in {0, 1}), both halves sent in ONE call with
  two pinning rows (-64, 63) that make FBGEMM pick scale 1 and zero point 64: every value a 7-bit integer, no 16-bit
  sum overflows, and ``2*acc_a + acc_b`` (recovered from the float32 output by dividing out the weight scale and
  rounding) is integer-exact while each half's |acc| < 2^23. 2M+2 rows of compute, one pass over the weights.
- ``fbgemm-vnni``: no split, where FBGEMM sums into 32 bits (``vnni_available``): pinning rows -127 and 128.
- ``onednn-vnni``: oneDNN's u8 x s8 linear (``qlinear_pointwise``) on the codes shifted to uint8, unit scales: its
  float32 output is the int32 accumulation; offered where running it shows 32-bit sums (``onednn_int8_bit_exact``).
- ``quasar``: our own kernel (``int8_linear``: AMX, AVX-512 VNNI, AVX-VNNI or AVX2), reading at the memory's rate.

All compute the same bits, so the default (``choice.int8_probe``, the fastest) moves speed, never an output.

Float kernels: ``torch`` (F.linear) and ``onednn`` (weights pre-packed once, row-invariant, as batched serving needs);
under ``onednn``, a 16-bit weight computing in float32 runs on ``quasar-half`` where it runs (``half_weights``).
"""

from __future__ import annotations

import functools
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import QuasarError
from ..files import first_line
from ..scheme import int8_matmul_int32, per_token_scale, quantize_activation
from . import half_linear as half_kernel
from . import int8_linear as int8_kernel

LinearFn = Callable[[torch.Tensor], torch.Tensor]
ZERO_POINT = 128  # int8 codes shifted to uint8 for oneDNN's u8 x s8 kernel
INT8_KERNELS = ("reference", "fbgemm", "fbgemm-vnni", "onednn-vnni", "quasar")
FLOAT_KERNELS = ("torch", "onednn")


def fbgemm_available() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def onednn_int8_available() -> bool:
    return hasattr(torch.ops.onednn, "qlinear_pointwise") and hasattr(torch.ops.onednn, "qlinear_prepack")


@functools.cache
def vnni_available() -> bool:
    """Whether FBGEMM's u8 x s8 kernel sums into 32 bits here, found by running it on codes whose pairs overflow 16 bits."""
    return fbgemm_available() and _sums_bit_exact(lambda wq, w_scale: _fbgemm(wq, w_scale, None, None, split=False))


def quasar_int8_available() -> bool:
    """Whether our own int8 kernel (a build of it) built and passed its self-check here (``int8_linear``)."""
    return int8_kernel.why_not() is None


@functools.cache
def onednn_int8_bit_exact() -> bool:
    """Whether oneDNN's u8 x s8 linear sums integer-exactly here, found by running it once like ``vnni_available``."""
    return onednn_int8_available() and _sums_bit_exact(lambda wq, w_scale: _onednn_int8(wq, w_scale, None, None))


def _sums_bit_exact(make: Callable[[torch.Tensor, torch.Tensor], LinearFn]) -> bool:
    """Whether ``make(wq, w_scale)`` equals the reference on codes whose pair sums overflow 16 bits (an error: not bit-exact)."""
    depth, width = 512, 32
    wq = torch.randint(-127, 128, (width, depth), generator=torch.Generator().manual_seed(0), dtype=torch.int8)
    wq[:8], wq[8:16] = 127, -127
    w_scale = torch.full((width, 1), 0.01)
    x = torch.full((3, depth), 1.0)
    x[1], x[2, ::2] = -1.0, -1.0
    try:
        return torch.equal(make(wq, w_scale)(x), _reference(wq, w_scale, None, None)(x))
    except RuntimeError:
        return False


def _fastest_ms(linear: LinearFn, rows: torch.Tensor, runs: int = 5) -> float:
    """The fastest of ``runs`` calls of ``linear`` on ``rows``, in ms, after one untimed call (the probes' timing)."""
    linear(rows)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        linear(rows)
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def default_float_kernel(device: str = "cpu") -> str:
    return "onednn" if device == "cpu" and onednn_available() else "torch"


FLOAT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
FLOAT_DTYPE_ENV = "QUASAR_FLOAT_DTYPE"  # a user's choice of the CPU float dtype, over the probe's
BF16_MIN_SPEEDUP = 1.3  # bf16 must beat float32 by this much: a CPU without native bf16 runs it several times slower


@dataclass(frozen=True)
class FloatProbe:
    """What running oneDNN's packed linear once in float32 and in bf16 showed (``float_probe``)."""

    float32_ms: float
    bfloat16_ms: float | None  # None: no bf16 linear here (``bf16_missing`` says why)
    bf16_invariant_rows: int  # the most rows one bf16 call takes with every row's bits those of the row alone
    bf16_missing: str | None = None  # why this CPU has no bf16 linear of oneDNN's (torch's refusal), else None

    @property
    def bf16_speedup(self) -> float:
        return self.float32_ms / self.bfloat16_ms if self.bfloat16_ms else 0.0

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.bf16_speedup >= BF16_MIN_SPEEDUP else torch.float32

    @property
    def reason(self) -> str:
        if self.bf16_missing:
            return f"no bf16 linear here: {self.bf16_missing}"
        return f"bf16 {self.bf16_speedup:.1f}x float32 at a verify step's shape (bf16 needs {BF16_MIN_SPEEDUP}x)"

    @property
    def rows_text(self) -> str | None:
        """How bf16 calls keep every row's bits its own, for reports (None where there is no bf16 linear)."""
        if self.bf16_missing:
            return None
        if self.bf16_invariant_rows >= BF16_ROW_COUNTS[-1]:
            return f"bf16 rows invariant up to {self.bf16_invariant_rows} per call, every count checked"
        return f"bf16 rows invariant up to {self.bf16_invariant_rows} per call here: larger calls are split"


# The row counts the probe checks one bf16 call at: every count a verify step or a batched serving step of up to 64
# rows makes, then prefill-sized ones up to PREFILL_CHUNK (256). Calls over the largest count that held are split.
BF16_ROW_COUNTS = (*range(2, 65), 96, 128, 192, 256)


@functools.cache
def float_probe() -> FloatProbe:
    """Times one verify-sized linear (6 rows, 1024 x 4096) in float32 and bf16 on oneDNN, once per process (CPUs without
    native bf16 emulate it several times slower), and finds how many rows one bf16 call may take, each row's bits its own."""
    generator = torch.Generator().manual_seed(0)
    weight, x = torch.randn(4096, 1024, generator=generator), torch.randn(BF16_ROW_COUNTS[-1], 1024, generator=generator)
    if not onednn_available():
        return FloatProbe(_fastest_ms(lambda rows: F.linear(rows, weight), x[:6]), None, 0, "torch was built without oneDNN")
    try:
        bf16_linear = _onednn_linear(weight.bfloat16(), None)
    except RuntimeError as refusal:  # oneDNN's bf16 needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT: an AVX2 CPU has neither
        return FloatProbe(_fastest_ms(_onednn_linear(weight, None), x[:6]), None, 0, first_line(refusal))
    rows = _bf16_invariant_rows(bf16_linear, x.bfloat16())
    times = {}
    for dtype, most in ((torch.float32, None), (torch.bfloat16, rows)):
        times[dtype] = _fastest_ms(_onednn_linear(weight.to(dtype), None, most), x[:6].to(dtype))
    return FloatProbe(times[torch.float32], times[torch.bfloat16], rows)


@functools.cache
def half_probe_ms() -> float | None:
    """``quasar-half`` timed once at ``float_probe``'s shape, for doctor (nothing is chosen by it); None where it cannot run."""
    if not half_weights(torch.bfloat16, torch.float32, "onednn"):
        return None
    generator = torch.Generator().manual_seed(0)
    weight, x = torch.randn(4096, 1024, generator=generator), torch.randn(6, 1024, generator=generator)
    return _fastest_ms(half_linear(weight.bfloat16(), None), x)


def _bf16_invariant_rows(linear: LinearFn, x: torch.Tensor) -> int:
    """The largest of ``BF16_ROW_COUNTS`` up to which every count's call gives each row the bits it gets alone."""
    alone = torch.cat([linear(row) for row in x.split(1)])
    most = 1
    for count in BF16_ROW_COUNTS:
        if not torch.equal(linear(x[:count]), alone[:count]):
            break
        most = count
    return most


def default_float_dtype(device: str = "cpu", name: str | None = None) -> torch.dtype:
    """The dtype float weights compute in: ``name``, else ``QUASAR_FLOAT_DTYPE``, else the CPU probe's choice (accelerators: bf16)."""
    name = name or os.environ.get(FLOAT_DTYPE_ENV)
    if not name:
        return float_probe().dtype if device == "cpu" else torch.bfloat16
    if name not in FLOAT_DTYPES:
        raise QuasarError(f"unknown float dtype {name!r}: choose from {', '.join(FLOAT_DTYPES)}")
    if FLOAT_DTYPES[name] == torch.bfloat16 and device == "cpu" and onednn_available():
        _bf16_rows_here()  # refused here, in one line, rather than when the first weight is packed
    return FLOAT_DTYPES[name]


def _bf16_rows_here() -> int:
    """The most rows one bf16 call takes here; a one-line error where oneDNN has no bf16 linear."""
    probe = float_probe()
    if probe.bf16_missing:
        raise QuasarError(f"bfloat16 cannot compute on this CPU ({probe.bf16_missing}): use float32")
    return probe.bf16_invariant_rows


def cpu_computes_bf16() -> bool:
    """Whether float parts compute in bf16 on this CPU (``default_float_dtype``)."""
    return default_float_dtype("cpu") == torch.bfloat16


def head_beside_graph(stored: torch.dtype) -> bool:
    """Whether a float lm_head stored as ``stored`` runs better on torch beside an ONNX Runtime graph (bf16, or quasar-half)."""
    return cpu_computes_bf16() or half_weights(stored, torch.float32, "onednn")


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: the name ``default_float_dtype`` takes and reports print."""
    return str(dtype).removeprefix("torch.")


def half_weights(stored: torch.dtype, dtype: torch.dtype, float_kernel: str) -> bool:
    """Whether a float weight stored as ``stored`` and computing in ``dtype`` runs on ``quasar-half``: under ``onednn``, a
    bf16 or float16 weight computing in float32, where the kernel runs (half the bytes of a float32 copy)."""
    if float_kernel != "onednn" or dtype != torch.float32 or stored not in (torch.bfloat16, torch.float16):
        return False
    return half_kernel.why_not() is None


def half_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> LinearFn:
    """The ``quasar-half`` kernel on ``weight`` as stored (bf16 or float16), packed once; float32 in and out."""
    return half_kernel.HalfWeightLinear(weight, bias)


def _onednn_packs(weight: torch.Tensor) -> bool:
    return weight.dtype in (torch.float32, torch.bfloat16) and weight.device.type == "cpu"


def packs_weight(weight: torch.Tensor, float_kernel: str, int8_kernel: str) -> bool:
    """Whether the kernel chosen for ``weight`` keeps its own packed copy, so the caller may release the original."""
    if weight.dtype == torch.int8:
        return int8_kernel != "reference"
    return float_kernel == "onednn" and _onednn_packs(weight)


def float_linear(weight: torch.Tensor, bias: torch.Tensor | None, kernel: str) -> LinearFn:
    if kernel == "torch":
        return lambda x: F.linear(x, weight, bias)
    if kernel == "onednn":
        if not _onednn_packs(weight):
            return lambda x: F.linear(x, weight, bias)
        most = _bf16_rows_here() if weight.dtype == torch.bfloat16 else None
        return _onednn_linear(weight, bias, most)
    raise ValueError(f"unknown float kernel {kernel!r}; choose from {FLOAT_KERNELS}")


def _onednn_linear(weight: torch.Tensor, bias: torch.Tensor | None, most_rows: int | None = None) -> LinearFn:
    """oneDNN's linear on ``weight`` packed once, made row-invariant (``_row_invariant``)."""
    packed = torch.ops.mkldnn._reorder_linear_weight(weight)
    return _row_invariant(lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], ""), most_rows)


def _row_invariant(linear: LinearFn, most_rows: int | None = None) -> LinearFn:
    """``linear`` with one input row sent as two and calls over ``most_rows`` rows split, so a row's result does not depend
    on its company (oneDNN takes another path for M = 1, in bf16 also above some M; tests/test_batching.py)."""

    def run(x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1:
            return linear(x.repeat(2, 1))[:1]
        if most_rows is not None and x.shape[0] > most_rows:
            return torch.cat([run(piece) for piece in x.split(most_rows)])
        return linear(x)

    return run


def _activation_scale(x: torch.Tensor, input_scale: torch.Tensor | None) -> torch.Tensor:
    return per_token_scale(x) if input_scale is None else input_scale.float().reshape(1, 1)


def _scaled(acc: torch.Tensor, scale: torch.Tensor, w_row: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The scheme's epilogue in the reference's order: float32(acc) * activation scale * weight scale (+ bias)."""
    y = acc.float().mul_(scale).mul_(w_row)  # in place: acc is the kernel's own temporary (a prefill's are megabytes)
    return y.add_(bias) if bias is not None else y


def _reference(wq, w_scale, bias, input_scale) -> LinearFn:
    w_row = w_scale.float().reshape(1, -1)

    def run(x: torch.Tensor) -> torch.Tensor:
        scale = _activation_scale(x, input_scale)
        return _scaled(int8_matmul_int32(quantize_activation(x, scale), wq), scale, w_row, bias)

    return run


def _fbgemm_packed(wq: torch.Tensor, w_scale: torch.Tensor):
    torch.backends.quantized.engine = "fbgemm"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        qweight = torch._make_per_channel_quantized_tensor(
            wq.cpu(), w_scale.reshape(-1).double().cpu(), torch.zeros(wq.shape[0], dtype=torch.long), 0
        )
    return torch.ops.quantized.linear_prepack(qweight, None)


def _fbgemm(wq, w_scale, bias, input_scale, split: bool) -> LinearFn:
    """FBGEMM's dynamic linear made bit-exact: ``split`` sends 7-bit halves (AVX2), else full-range rows (VNNI)."""
    packed = _fbgemm_packed(wq, w_scale)
    w_row = w_scale.float().reshape(1, -1)
    inv_w = 1.0 / w_scale.double().reshape(1, -1)
    pin = torch.zeros(2, wq.shape[1])  # two rows that make FBGEMM's per-tensor quantization of the input pick scale 1
    pin[0, 0], pin[1, 0] = (-64.0, 63.0) if split else (-127.0, 128.0)

    def accumulate(q: torch.Tensor) -> torch.Tensor:
        """The integer-exact products of the int8 rows ``q`` with the weights, as float64."""
        rows = q.shape[0]
        if not split:
            out = torch.ops.quantized.linear_dynamic(torch.cat([q, pin]), packed, False)
            return out[:rows].double().mul_(inv_w).round_()
        high = torch.floor(q * 0.5)
        out = torch.ops.quantized.linear_dynamic(torch.cat([high, q - 2.0 * high, pin]), packed, True)
        halves = out[: 2 * rows].double().mul_(inv_w).round_()
        return 2.0 * halves[:rows] + halves[rows:]

    def run(x: torch.Tensor) -> torch.Tensor:
        scale = _activation_scale(x, input_scale)
        return _scaled(accumulate(quantize_activation(x, scale)), scale, w_row, bias)

    return run


def _onednn_int8(wq, w_scale, bias, input_scale) -> LinearFn:
    """oneDNN's int8 linear with unit scales: its output is the integer-exact accumulation as float32."""
    packed = torch.ops.onednn.qlinear_prepack(wq.cpu(), None)
    unit_scales, zero_points = torch.ones(wq.shape[0]), torch.zeros(wq.shape[0], dtype=torch.long)
    w_row = w_scale.float().reshape(1, -1)

    def run(x: torch.Tensor) -> torch.Tensor:
        scale = _activation_scale(x, input_scale)
        codes = quantize_activation(x, scale).add_(ZERO_POINT).to(torch.uint8)
        acc = torch.ops.onednn.qlinear_pointwise(
            codes, 1.0, ZERO_POINT, packed, unit_scales, zero_points, None, 1.0, 0, torch.float32, "none", [], ""
        )
        return _scaled(acc, scale, w_row, bias)

    return run


def int8_linear(
    wq: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None, input_scale: torch.Tensor | None, kernel: str
) -> LinearFn:
    """A function computing the scheme's W8A8 linear on 2-D float input, with the chosen kernel."""
    check_int8_kernel(kernel)
    if kernel == "reference":
        return _reference(wq, w_scale, bias, input_scale)
    if kernel == "onednn-vnni":
        return _onednn_int8(wq, w_scale, bias, input_scale)
    if kernel == "quasar":
        return int8_kernel.PackedInt8Linear(wq, w_scale, bias, input_scale)
    return _fbgemm(wq, w_scale, bias, input_scale, split=kernel == "fbgemm")


def int8_kernel_label(kernel: str) -> str:
    """``kernel`` as reports name it: ours with the build that runs here (``quasar-avx2``), where builds time apart."""
    if kernel != "quasar" or not quasar_int8_available():
        return kernel
    return f"quasar-{int8_kernel.build().removeprefix('cpu_int8-')}"


def check_int8_kernel(kernel: str) -> None:
    """Refuse in one line an int8 kernel that does not exist, or that this CPU or PyTorch build cannot run bit-exact."""
    if kernel not in INT8_KERNELS:
        raise QuasarError(f"unknown kernel {kernel!r}: the int8 kernels are {', '.join(INT8_KERNELS)}")
    if kernel.startswith("fbgemm") and not fbgemm_available():
        raise QuasarError(f"the {kernel} kernel needs a PyTorch build with FBGEMM (x86 CPUs)")
    if kernel == "fbgemm-vnni" and not vnni_available():
        raise QuasarError("the fbgemm-vnni kernel needs a CPU with AVX-512 VNNI (its AVX2 kernel would overflow)")
    if kernel == "onednn-vnni" and not onednn_int8_bit_exact():
        raise QuasarError("the onednn-vnni kernel needs a CPU where oneDNN's int8 linear sums in 32 bits (AVX-512 VNNI)")
    if kernel == "quasar" and not quasar_int8_available():
        raise QuasarError(f"the quasar kernel does not run here: {int8_kernel.why_not()}")
