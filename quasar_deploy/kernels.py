"""Linear-layer kernels: which arithmetic each one really computes, and how it is chosen.

Int8 kernels (all compute the W8A8 scheme of ``scheme.py`` with exact integer
accumulation; they differ only in speed and in where they run):

- ``reference``: plain PyTorch, float64 accumulation of integer values (exact). The oracle.
- ``fbgemm``: FBGEMM's u8 x s8 dynamic linear. On AVX2 without VNNI its kernel sums
  pairs of u8*s8 products in saturating 16-bit registers, which overflows when
  activations use the full 8-bit range. We therefore split each int8 activation
  row ``q`` into ``q = 2*a + b`` with ``a`` in [-64, 63] and ``b`` in {0, 1}, and
  send both halves through ONE call (rows stacked, so the weights are read once)
  together with two pinning rows holding -64 and 63, which make FBGEMM's own
  per-tensor quantization pick scale 1 and zero point 64: every value is then an
  exact 7-bit integer, no 16-bit sum can overflow, and ``2*acc_a + acc_b`` is the
  exact int8 accumulation (recovered from FBGEMM's float output by dividing out
  the weight scale and rounding; exact while each half's |acc| stays below 2^23,
  since FBGEMM hands back float32: the worst case 64*127*K passes that at K > 1032,
  real activation rows sit far below it, and the tests compare against the
  reference). Cost: 2M+2 rows of compute, one pass over the weights.
- ``fbgemm-vnni``: the same call without the split, for CPUs with AVX-512 VNNI, where
  FBGEMM's kernel accumulates u8*s8 products straight into 32 bits and cannot overflow:
  the full-range int8 rows plus pinning rows -127 and 128 (scale 1, zero point 127), M+2
  rows of compute; the accumulation is recovered as above (exact while |acc| < 2^23).
  Offered where running it once shows 32-bit sums (``vnni_available``); tested bit-identical to the
  reference there.
- ``onednn-vnni``: oneDNN's u8 x s8 int8 linear (``torch.ops.onednn.qlinear_pointwise``, the op torch's own x86
  int8 path uses), fed the int8 codes shifted to uint8 (zero point 128) with unit scales, so its float32 output is
  the int32 accumulation converted once, as the reference's ``.float()`` converts its exact sum; the scheme's
  scaling follows in the reference's order. Exact at any K where oneDNN multiplies with VNNI (32-bit lanes);
  without VNNI its AVX2 int8 kernels may sum in saturating 16-bit lanes, so it is offered only where running it
  once shows exact sums (``onednn_int8_exact``).
  No pinning rows and no float64 recovery. Tested bit-identical to the reference.
- ``quasar``: our own kernel (``backends/cpu_int8.c``), built with the system's C compiler for AMX tiles, AVX-512
  VNNI, AVX-VNNI or AVX2, the widest build whose self-check runs (``cpu_int8.build``; ``cpu_int8.why_not`` where
  none does). It streams weights packed for it, so a verify step's linears read int8 weights at close to the memory's
  rate, which the library kernels do not; it quantizes, sums (exactly in 32 bits on every build, AVX2's included)
  and scales in C, bit for bit as the reference does. Tested bit-identical to the reference on every build.
- ``cuda`` / ``npu`` kernels live with their backends.

Where several kernels are exact, the default is the one a timing on a verify step's shape finds fastest
(``int8_probe``; FBGEMM's split kernel is timed only where its 32-bit one is not exact): all compute the same bits, so
the choice moves speed, never an output.

Float kernels: ``torch`` (F.linear, MKL on x86) and ``onednn`` (weights pre-packed
once for oneDNN, measured faster than MKL at small M on AMD parts). Only ``onednn`` is
row-invariant (a row's result does not depend on the other rows of the call), which a
batched serving step needs; MKL's blocking changes a row's rounding with M. Under ``onednn``, a weight stored in 16
bits (bf16, float16: a real model's lm_head or tied table) that computes in float32 (a CPU without native bf16) runs on
our ``quasar-half`` kernel instead (``backends/cpu_half.c``) where it runs: it reads the weight as stored, half the
bytes oneDNN's float32 copy takes, widens it exactly and sums in float32, row-invariant too (``half_weights``).
"""

from __future__ import annotations

import functools
import hashlib
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import probe_store
from .errors import QuasarError
from .files import first_line
from .scheme import QMAX, int8_matmul_exact, per_token_scale, quantize_activation

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
    """Whether FBGEMM's u8 x s8 kernel sums products straight into 32 bits here (its AVX-512 VNNI kernel), found by
    running it once on codes whose product pairs overflow 16 bits; its AVX2 kernel saturates them.

    Asked of the kernel, not of ``/proc/cpuinfo``: which kernel FBGEMM dispatches to is its own decision, and a listed
    instruction set may not run (AMX faults in a process that has not asked Linux for its state).
    """
    return fbgemm_available() and _sums_exactly(lambda wq, w_scale: _fbgemm(wq, w_scale, None, None, split=False))


def quasar_int8_available() -> bool:
    """Whether our own int8 kernel (a build of it) built and passed its self-check here (``backends.cpu_int8``)."""
    from .backends import cpu_int8

    return cpu_int8.why_not() is None


@functools.cache
def onednn_int8_exact() -> bool:
    """Whether oneDNN's u8 x s8 linear sums exactly here (32-bit lanes), found by running it once like ``vnni_available``."""
    return onednn_int8_available() and _sums_exactly(lambda wq, w_scale: _onednn_int8(wq, w_scale, None, None))


def _sums_exactly(make: Callable[[torch.Tensor, torch.Tensor], LinearFn]) -> bool:
    """Whether the int8 linear ``make(wq, w_scale)`` equals the reference on full-range codes (255 x +-127 pairs
    overflow a 16-bit sum), past 2^15 at K = 512; any error from the kernel counts as not exact."""
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


PROBE_ROWS = (6, 48)  # a verify block, and a batched serving step of 8 sequences
ONNXRUNTIME = "onnxruntime"  # ONNX Runtime's int8 linear in the probe's timings (not a kernel of the torch backend)
# how much faster than ONNX Runtime's int8 linear the torch backend's must time for the cpu backend to run artifacts:
# a whole step costs ORT's single graph less around its linears than it costs the torch backend (the runs that set it:
# docs/cpu-kinds.md, "Our AVX2 build under the view")
ONNXRUNTIME_MARGIN = 1.25


@dataclass(frozen=True)
class Int8Probe:
    """What timing the exact int8 kernels once showed (``int8_probe``): ms of one call at each of ``PROBE_ROWS``,
    summed, per kernel timed here (``int8_kernels_to_time``)."""

    ms: dict[str, float]
    timed: str | None = None  # when it was timed (UTC), here or by an earlier process (``probe_store``); None: not timed

    @property
    def kernel(self) -> str:
        """The fastest exact kernel of the torch backend; with none here, the reference."""
        ours = {name: ms for name, ms in self.ms.items() if name != ONNXRUNTIME}
        return min(ours, key=ours.__getitem__) if ours else "reference"

    @property
    def cpu_beats_onnxruntime(self) -> bool:
        """Whether the torch backend's kernel timed faster than ONNX Runtime's int8 linear by ``ONNXRUNTIME_MARGIN``
        (true where ORT was not timed: not installed, or not exact)."""
        return ONNXRUNTIME not in self.ms or self.ms[self.kernel] * ONNXRUNTIME_MARGIN <= self.ms[ONNXRUNTIME]

    @property
    def reason(self) -> str:
        if not self.ms:
            return "no exact int8 kernel but the reference here (no FBGEMM, and no build of ours runs)"
        if len(self.ms) == 1:
            return "the only exact int8 kernel here"
        times = ", ".join(f"{name} {ms:.2f} ms" for name, ms in self.ms.items())
        when = f"; timed {self.timed}, kept: {probe_store.REPROBE_ENV}=1 times again" if self.timed else ""
        ort = "" if self.cpu_beats_onnxruntime else f"; ours not {ONNXRUNTIME_MARGIN}x faster than ONNX Runtime's: W8A8 artifacts run there"
        return f"the fastest at {' and '.join(map(str, PROBE_ROWS))} rows ({times}{when}){ort}"


PROBE_SHAPE = (4096, 2048)  # (out, in) of the probe's weight: 8 MB, a 1.7B model's attention projection
PROBE_COPIES = 6  # packed copies of it timed in turn: 48 MB, more than a server CPU's last-level cache


@functools.cache
def int8_probe() -> Int8Probe:
    """Times the exact int8 kernels here (``int8_kernels_to_time``) once per machine, each on
    ``PROBE_COPIES`` packed copies of one linear of a verify step's shape in turn (more than a last-level cache holds,
    so the weights come from memory, as in a model's step; one cached weight times the arithmetic instead), the
    kernels interleaved run by run so that drift hits all alike. All compute the same bits (exact), so the kernel
    changes speed only, never an output; which is fastest depends on the CPU and the row count, so it is timed. The
    timing is kept (``probe_store``) and later processes on this machine reuse it: ``auto``'s backend follows the pick,
    and a near tie must not send one process to another backend than the next."""
    kernels = int8_kernels_to_time()
    if len(kernels) < 2:
        return Int8Probe({name: 0.0 for name in kernels})
    key = _int8_probe_key(kernels)
    kept = probe_store.recall(key)
    if kept is not None and set(kept[0]) == set(kernels):
        return Int8Probe({name: float(kept[0][name]) for name in kernels}, kept[1])
    ms = _time_int8_kernels(kernels)
    return Int8Probe(ms, probe_store.keep(key, ms))


def int8_kernels_to_time() -> list[str]:
    """The int8 kernels ``int8_probe`` times here: ``fbgemm-vnni`` and ``onednn-vnni`` where they sum in 32 bits, our
    ``quasar`` where a build of it runs, and FBGEMM's split kernel where its own does not sum in 32 bits (an AVX2 CPU:
    exact there at twice the rows, and so possibly still faster than our AVX2 build); and beside them, where ONNX
    Runtime is installed and exact, its ``MatMulInteger`` (``ONNXRUNTIME``: what the backend choice weighs, never a
    kernel of the torch backend)."""
    offered = (
        ("fbgemm-vnni", vnni_available()),
        ("onednn-vnni", onednn_int8_exact()),
        ("quasar", quasar_int8_available()),
        ("fbgemm", fbgemm_available() and not vnni_available()),
    )
    kernels = [name for name, here in offered if here]
    return [*kernels, ONNXRUNTIME] if kernels and onnxruntime_int8_exact() else kernels


@functools.cache
def onnxruntime_int8_exact() -> bool:
    """Whether ONNX Runtime is installed and its CPU ``MatMulInteger`` sums exactly here (with or without options)."""
    from .backends.onnxruntime import exact_int8_entries, unavailable

    if unavailable() is not None:
        return False
    try:
        exact_int8_entries()
    except QuasarError:
        return False
    return True


def _int8_probe_key(kernels: list[str]) -> dict:
    """What the int8 timing depends on: the CPU, the threads, the software, our kernel's source and build."""
    from ._version import __version__
    from .backends import cpu_int8
    from .cpuinfo import cpu_model

    return {
        "probe": "int8",
        "kernels": kernels,
        "cpu": cpu_model(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "quasar_deploy": __version__,
        "kernel_source": hashlib.sha256(cpu_int8.SOURCE.read_bytes()).hexdigest()[:16],
        "kernel_build": cpu_int8.build(),  # the AMX build or the vector one: they time apart
        "onnxruntime": _onnxruntime_version() if ONNXRUNTIME in kernels else None,
        "shape": [*PROBE_SHAPE, PROBE_COPIES, *PROBE_ROWS],
    }


def _onnxruntime_version() -> str:
    import onnxruntime

    return onnxruntime.__version__


def _time_int8_kernels(kernels: list[str]) -> dict[str, float]:
    """``int8_probe``'s timing, ms per kernel: the fastest of four interleaved rounds, summed over ``PROBE_ROWS``."""
    generator = torch.Generator().manual_seed(0)
    wq = torch.randint(-127, 128, PROBE_SHAPE, generator=generator, dtype=torch.int8)
    w_scale = torch.full((PROBE_SHAPE[0], 1), 0.01)
    x = torch.randn(max(PROBE_ROWS), PROBE_SHAPE[1], generator=generator)
    chains = {name: [_probe_linear(wq, w_scale, name) for _ in range(PROBE_COPIES)] for name in kernels}
    best = {(name, rows): float("inf") for name in kernels for rows in PROBE_ROWS}
    for _ in range(4):  # the first round warms up; the fastest of the rounds counts
        for (name, rows), ms in best.items():
            best[name, rows] = min(ms, _chain_ms(chains[name], x[:rows]))
    return {name: sum(best[name, rows] for rows in PROBE_ROWS) for name in kernels}


def _probe_linear(wq: torch.Tensor, w_scale: torch.Tensor, name: str) -> LinearFn:
    return _onnxruntime_int8(wq, w_scale) if name == ONNXRUNTIME else int8_linear(wq, w_scale, None, None, name)


def _chain_ms(linears: list[LinearFn], rows: torch.Tensor) -> float:
    start = time.perf_counter()
    for linear in linears:
        linear(rows)
    return (time.perf_counter() - start) * 1e3


def _fastest_ms(linear: LinearFn, rows: torch.Tensor, runs: int = 5) -> float:
    """The fastest of ``runs`` calls of ``linear`` on ``rows``, in ms, after one untimed call (the probes' timing)."""
    linear(rows)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        linear(rows)
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def default_int8_kernel(device: str = "cpu") -> str:
    """The fastest exact int8 kernel here (``int8_probe``); ``reference`` off the CPU."""
    return int8_probe().kernel if device == "cpu" else "reference"


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
    """Times one verify-sized linear (6 rows, 1024 x 4096) in float32 and bf16 on oneDNN's packed kernel, once per
    process, and finds how many rows one bf16 call may take with each row's result the row's own (alone).

    CPUs with native bf16 (avx512_bf16, AMX) run bf16 2-4x faster than float32 at this shape, reading half the
    bytes; others emulate it several times slower. The gap is wide either way, so a short timing decides it, where
    ``/proc/cpuinfo`` cannot (it lists instruction sets that fault here). oneDNN's bf16 kernel changes with the row
    count on some CPUs (seen: rows agree up to 32 per call, then a call of 33 or more rounds some rows otherwise), so
    bf16 calls are split at the largest count that held (``float_linear``): verification stays lossless and a
    sequence's rows stay the same among other sequences'.
    """
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
    """``quasar-half`` timed once per process at ``float_probe``'s shape (6 rows, 1024 x 4096, the weight stored bf16),
    for doctor beside the probe's float32 time; None where it does not run. Nothing is chosen by it
    (``half_weights``), so loading a model never pays for it."""
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
    """The dtype float weights compute in on ``device``: ``name`` ("float32" or "bfloat16"), else the user's
    ``QUASAR_FLOAT_DTYPE``, else on a CPU the probe's choice (bf16 where it is fast and row-invariant, float32
    elsewhere); accelerators compute bf16."""
    name = name or os.environ.get(FLOAT_DTYPE_ENV)
    if not name:
        return float_probe().dtype if device == "cpu" else torch.bfloat16
    if name not in FLOAT_DTYPES:
        raise QuasarError(f"unknown float dtype {name!r}: choose from {', '.join(FLOAT_DTYPES)}")
    if FLOAT_DTYPES[name] == torch.bfloat16 and device == "cpu" and onednn_available():
        _bf16_rows_here()  # refused here, in one line, rather than when the first weight is packed
    return FLOAT_DTYPES[name]


def _bf16_rows_here() -> int:
    """The most rows one bf16 call takes here (``FloatProbe.bf16_invariant_rows``); a one-line error where oneDNN,
    which packs every CPU float linear (row-invariant where torch's own kernels promise nothing), has no bf16 one."""
    probe = float_probe()
    if probe.bf16_missing:
        raise QuasarError(f"bfloat16 cannot compute on this CPU ({probe.bf16_missing}): use float32")
    return probe.bf16_invariant_rows


def cpu_computes_bf16() -> bool:
    """Whether float parts compute in bf16 on this CPU (``default_float_dtype``): what the backend choice, the ONNX
    export's head and the benchmarks' contenders follow."""
    return default_float_dtype("cpu") == torch.bfloat16


def head_beside_graph(stored: torch.dtype) -> bool:
    """Whether a float lm_head stored as ``stored`` runs better on torch beside an ONNX Runtime graph than inside it
    (ORT's CPU MatMul computes float32 from a float32 copy): where the CPU computes bf16, or where ``quasar-half``
    computes float32 from the weight as stored (``half_weights``), reading half the bytes either way."""
    return cpu_computes_bf16() or half_weights(stored, torch.float32, "onednn")


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: the name ``default_float_dtype`` takes and reports print."""
    return str(dtype).removeprefix("torch.")


def half_weights(stored: torch.dtype, dtype: torch.dtype, float_kernel: str) -> bool:
    """Whether a float weight stored as ``stored`` and computing in ``dtype`` runs on the ``quasar-half`` kernel: under
    ``onednn`` (the cpu backend's), a bf16 or float16 weight computing in float32, where the kernel runs
    (``cpu_half.why_not``). No timing decides it: a real lm_head is read from memory each step, and this kernel reads
    half the bytes oneDNN's float32 copy would, the same products summed in float32; doctor shows both timed at a
    verify step's shape (``half_probe_ms``)."""
    if float_kernel != "onednn" or dtype != torch.float32 or stored not in (torch.bfloat16, torch.float16):
        return False
    from .backends import cpu_half

    return cpu_half.why_not() is None


def half_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> LinearFn:
    """The ``quasar-half`` kernel on ``weight`` as stored (bf16 or float16), packed once; float32 in and out."""
    from .backends.cpu_half import HalfWeightLinear

    return HalfWeightLinear(weight, bias)


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
    """``linear`` with one input row sent as two, and calls over ``most_rows`` rows split: every row's result then no
    longer depends on how many rows came along.

    Tested (tests/test_batching.py): oneDNN computes each row of an M >= 2 call bit for bit alike whatever
    M is, but takes another path for M = 1 when K > 1024, with other rounding; in bf16 some CPUs switch paths again
    above some M (``float_probe`` finds where). A one-token decode step and the same row among other sequences' rows
    (a batched serving step) must agree exactly; the duplicate row costs one more row of compute on weights read
    once, a split call one more read of the weights.
    """

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
    """The scheme's epilogue, in the reference's order: float32(acc) * activation scale * weight scale (+ bias); every
    kernel ends here, so all of them round as the reference does."""
    y = acc.float().mul_(scale).mul_(w_row)  # in place: acc is the kernel's own temporary (a prefill's are megabytes)
    return y.add_(bias) if bias is not None else y


def _reference(wq, w_scale, bias, input_scale) -> LinearFn:
    w_row = w_scale.float().reshape(1, -1)

    def run(x: torch.Tensor) -> torch.Tensor:
        scale = _activation_scale(x, input_scale)
        return _scaled(int8_matmul_exact(quantize_activation(x, scale), wq), scale, w_row, bias)

    return run


def _fbgemm_packed(wq: torch.Tensor, w_scale: torch.Tensor):
    torch.backends.quantized.engine = "fbgemm"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        qweight = torch._make_per_channel_quantized_tensor(
            wq.cpu(), w_scale.reshape(-1).double().cpu(), torch.zeros(wq.shape[0], dtype=torch.long), 0
        )
    return torch.ops.quantized.linear_prepack(qweight, None)


def _pinning_rows(in_features: int, low: float, high: float) -> torch.Tensor:
    """Two rows holding ``low`` and ``high``: FBGEMM's per-tensor quantization of the stacked input then picks scale 1."""
    pin = torch.zeros(2, in_features)
    pin[0, 0], pin[1, 0] = low, high
    return pin


def _fbgemm(wq, w_scale, bias, input_scale, split: bool) -> LinearFn:
    """FBGEMM's dynamic linear made exact: ``split`` sends 7-bit halves (AVX2), else full-range rows (VNNI)."""
    packed = _fbgemm_packed(wq, w_scale)
    w_row = w_scale.float().reshape(1, -1)
    inv_w = 1.0 / w_scale.double().reshape(1, -1)
    pin = _pinning_rows(wq.shape[1], *((-64.0, 63.0) if split else (-127.0, 128.0)))

    def accumulate(q: torch.Tensor) -> torch.Tensor:
        """The exact integer products of the int8 rows ``q`` with the weights, as float64."""
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
    """oneDNN's int8 linear with unit scales: its output is the exact accumulation as float32 (see the module doc)."""
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


def _onnxruntime_int8(wq, w_scale) -> LinearFn:
    """The scheme's W8A8 linear as ONNX Runtime runs it in the integer graph: the exporter's own nodes for one linear
    (codes, ``MatMulInteger``, scaling; ``exporters.onnx_graph.w8a8_linear``) in a session with the backend's options.
    Not a kernel of the torch backend: ``int8_probe`` times it beside them, so that ``auto`` sends an artifact to ONNX
    Runtime where its int8 linear is the faster one (``Int8Probe.cpu_beats_onnxruntime``)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from .backends.onnxruntime import session_options
    from .exporters.onnx_graph import GraphBuilder, w8a8_linear

    g = GraphBuilder("integer")
    y = w8a8_linear(g, "x", wq.numpy(), w_scale.float().numpy(), None, "probe")
    model = g.model(
        "linear",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, wq.shape[1]])],
        [helper.make_tensor_value_info(y, TensorProto.FLOAT, [None, wq.shape[0]])],
    )
    options = session_options(torch.get_num_threads(), fixed_shape=True)
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return lambda x: torch.from_numpy(session.run(None, {"x": x.numpy()})[0])


def int8_linear(
    wq: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None,
    input_scale: torch.Tensor | None,
    kernel: str,
) -> LinearFn:
    """A function computing the scheme's W8A8 linear on 2-D float input, with the chosen kernel."""
    check_int8_kernel(kernel)
    if kernel == "reference":
        return _reference(wq, w_scale, bias, input_scale)
    if kernel == "onednn-vnni":
        return _onednn_int8(wq, w_scale, bias, input_scale)
    if kernel == "quasar":
        from .backends.cpu_int8 import PackedInt8Linear

        return PackedInt8Linear(wq, w_scale, bias, input_scale)
    return _fbgemm(wq, w_scale, bias, input_scale, split=kernel == "fbgemm")


def int8_kernel_label(kernel: str) -> str:
    """``kernel`` as reports name it: ours with the build that runs here (``quasar-avx2``), where builds time apart."""
    if kernel != "quasar" or not quasar_int8_available():
        return kernel
    from .backends import cpu_int8

    return f"quasar-{cpu_int8.build().removeprefix('cpu_int8-')}"


def check_int8_kernel(kernel: str) -> None:
    """Refuse in one line an int8 kernel that does not exist, or that this CPU or PyTorch build cannot run exactly."""
    if kernel not in INT8_KERNELS:
        raise QuasarError(f"unknown kernel {kernel!r}: the int8 kernels are {', '.join(INT8_KERNELS)}")
    if kernel.startswith("fbgemm") and not fbgemm_available():
        raise QuasarError(f"the {kernel} kernel needs a PyTorch build with FBGEMM (x86 CPUs)")
    if kernel == "fbgemm-vnni" and not vnni_available():
        raise QuasarError("the fbgemm-vnni kernel needs a CPU with AVX-512 VNNI (its AVX2 kernel would overflow)")
    if kernel == "onednn-vnni" and not onednn_int8_exact():
        raise QuasarError("the onednn-vnni kernel needs a CPU where oneDNN's int8 linear sums in 32 bits (AVX-512 VNNI)")
    if kernel == "quasar" and not quasar_int8_available():
        from .backends import cpu_int8

        raise QuasarError(f"the quasar kernel does not run here: {cpu_int8.why_not()}")


__all__ = [
    "FLOAT_DTYPES",
    "FLOAT_KERNELS",
    "FloatProbe",
    "Int8Probe",
    "check_int8_kernel",
    "cpu_computes_bf16",
    "default_float_dtype",
    "dtype_name",
    "float_probe",
    "int8_kernel_label",
    "int8_probe",
    "onednn_int8_exact",
    "onnxruntime_int8_exact",
    "quasar_int8_available",
    "INT8_KERNELS",
    "QMAX",
    "default_float_kernel",
    "default_int8_kernel",
    "fbgemm_available",
    "vnni_available",
    "float_linear",
    "half_linear",
    "half_probe_ms",
    "half_weights",
    "head_beside_graph",
    "int8_linear",
    "onednn_available",
    "onednn_int8_available",
    "packs_weight",
]
