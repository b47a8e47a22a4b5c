"""What every ONNX Runtime session of ours shares: its options (threads, spinning, the exact int8 entries found by
running ORT's ``MatMulInteger`` once), whether ORT is installed, and the float lm_head that runs beside a graph on
torch. Below both ORT backends (``onnxruntime``, ``onnx_layered``) and the int8 kernel choice (``cpu/choice.py``).
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..cpu.linears import default_float_dtype, default_float_kernel
from ..cpu.machine import default_threads
from ..errors import QuasarError
from ..model import Linear

if TYPE_CHECKING:
    import onnx  # imported where a probe is built: loading this module needs neither onnx nor onnxruntime

# x64 CPUs without VNNI sum u8 x s8 product pairs in saturating 16-bit lanes; this option makes ORT re-encode int8
# weights as uint8 at load and run its exact u8 x u8 kernel (on every x64 CPU, VNNI ones included, where it is slower:
# VNNI multiplies u8 x s8 only; `bench onnx layers` times both)
PRECISE_INT8_OPTION = ("session.x64quantprecision", "1")
SPINNING_OPTION = "session.intra_op.allow_spinning"


def allow_spinning(environ=os.environ) -> str:
    """ORT's intra-op threads spin between calls as OpenMP's do: off where the OpenMP policy is passive (the CLI picks
    that on an oversubscribed machine, or the user did), where spinning threads take the cores the work needs
    (``cpuinfo.prefer_passive_waits``)."""
    return "0" if environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE" else "1"


def session_options(threads: int | None = None, head_on_torch: bool = False, fixed_shape: bool = False):
    """The options every ORT session of ours gets: ``threads`` intra-op threads (default: the CPUs this process may use;
    ORT's own default counts the host's cores), ``exact_int8_entries``, and the spinning policy of ``allow_spinning``.

    ``head_on_torch``: the graph's lm_head runs on torch right after each call (``load_head``), so ORT's threads must
    sleep at once: spinning, they hold the cores torch's head needs (``bench onnx step`` times that arrangement).

    ORT's memory pattern is off unless ``fixed_shape`` (a graph run at one shape, such as the int8 probe's): ORT traces
    the allocations of each new set of input shapes on its first run and plans one block for them on later runs, and a
    decoder's shapes change at every step (the past grows). The first generation after ``load`` met a new shape at
    every step and paid a trace at each, while later generations of the same lengths replayed the cached plans, so the
    first ran at 0.6-0.8x of the next ones (``bench first-call``; docs/architecture.md, "Warm-up"), and the plans
    piled up, one per shape seen."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads or default_threads()
    options.enable_mem_pattern = fixed_shape
    for entry in exact_int8_entries():
        options.add_session_config_entry(*entry)
    options.add_session_config_entry(SPINNING_OPTION, "0" if head_on_torch else allow_spinning())
    return options


@functools.cache
def exact_int8_entries() -> tuple[tuple[str, str], ...]:
    """The session config under which ORT's CPU ``MatMulInteger`` (u8 x s8) is exact on this CPU, found by running it.

    Without options where it multiplies with VNNI; with ``PRECISE_INT8_OPTION`` where its u8 x s8 kernel would saturate.
    Asked of the kernel rather than of CPU flags, because which kernel MLAS dispatches to is its own decision."""
    for entries in ((), (PRECISE_INT8_OPTION,)):
        if _int8_matmul_exact(entries):
            return entries
    raise QuasarError(
        "ONNX Runtime's int8 MatMulInteger is not exact on this CPU, even with session.x64quantprecision=1; "
        "run W8A8 on the cpu backend (--backend cpu)"
    )


def int8_probe() -> tuple[onnx.ModelProto, np.ndarray, np.ndarray]:
    """The model ``exact_int8_entries`` runs: a u8 x s8 ``MatMulInteger`` whose weight has whole columns of +-127, with
    its weight [256, 32] and the codes it is fed [6, 256]: a row of 255 (pair sums 2 x 255 x 127 overflow 16 bits), a row
    of 0, random rows. Declared as the integer graph is (opset and IR version), since it runs in every process that
    builds an ORT session, on each ORT that runs those graphs."""
    from onnx import TensorProto, helper, numpy_helper

    from ..exporters.onnx_versions import OPSETS, make_model

    depth, width = 256, 32
    weight = np.random.default_rng(0).integers(-127, 128, (depth, width)).astype(np.int8)
    weight[:, :8], weight[:, 8:16] = 127, -127
    graph = helper.make_graph(
        [helper.make_node("MatMulInteger", ["x", "w", "zero", "weight_zero"], ["y"])],  # both zero points, as exported
        "probe",
        [helper.make_tensor_value_info("x", TensorProto.UINT8, [None, depth])],
        [helper.make_tensor_value_info("y", TensorProto.INT32, [None, width])],
        [
            numpy_helper.from_array(weight, "w"),
            numpy_helper.from_array(np.array(128, np.uint8), "zero"),
            numpy_helper.from_array(np.array(0, np.int8), "weight_zero"),
        ],
    )
    codes = np.random.default_rng(1).integers(0, 256, (6, depth)).astype(np.uint8)
    codes[0], codes[1] = 255, 0
    return make_model(graph, OPSETS["integer"]), weight, codes


def _int8_matmul_exact(entries: tuple[tuple[str, str], ...]) -> bool:
    """Whether u8 x s8 products at the codes' extremes (255 x +-127, whose pair sums overflow 16 bits) sum exactly."""
    import onnxruntime as ort

    model, weight, codes = int8_probe()
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    for entry in entries:
        options.add_session_config_entry(*entry)
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    for rows in (codes[:1], codes):
        expected = (rows.astype(np.int64) - 128) @ weight.astype(np.int64)
        if not np.array_equal(session.run(None, {"x": rows})[0], expected):
            return False
    return True


def unavailable() -> str | None:
    try:
        import onnxruntime  # noqa: F401
    except ImportError:
        return "onnxruntime is not installed (pip install onnxruntime, or onnxruntime-gpu for CUDA/TensorRT)"
    return None


def head_beside(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
    """A float lm_head as it runs beside a graph: torch's float kernel (oneDNN, packed) in the CPU's float dtype."""
    head = Linear(weight, bias, default_float_dtype("cpu"))
    head.prepare(default_float_kernel("cpu"))
    return head
