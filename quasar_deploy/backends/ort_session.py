"""What every ONNX Runtime session of ours shares: its options (threads, spinning, the bit-exact int8 entries), whether ORT
is installed, and the float lm_head that runs beside a graph on torch.
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

# x64 CPUs without VNNI sum u8 x s8 product pairs in saturating 16-bit lanes; this option makes ORT run its
# integer-exact u8 x u8 kernel instead (slower where VNNI runs)
PRECISE_INT8_OPTION = ("session.x64quantprecision", "1")
SPINNING_OPTION = "session.intra_op.allow_spinning"


def allow_spinning(environ=os.environ) -> str:
    """ORT's intra-op threads spin between calls unless the OpenMP policy is passive (``prefer_passive_waits``)."""
    return "0" if environ.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE" else "1"


def session_options(threads: int | None = None, head_on_torch: bool = False, fixed_shape: bool = False):
    """The options every ORT session of ours gets: ``threads``, ``bit_exact_int8_entries``, ``allow_spinning`` (off with
    ``head_on_torch``), and ORT's memory pattern off unless ``fixed_shape`` (a decoder's shapes change at every step)."""
    import onnxruntime as ort  # optional: onnxruntime

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads or default_threads()
    options.enable_mem_pattern = fixed_shape
    for entry in bit_exact_int8_entries():
        options.add_session_config_entry(*entry)
    options.add_session_config_entry(SPINNING_OPTION, "0" if head_on_torch else allow_spinning())
    return options


@functools.cache
def bit_exact_int8_entries() -> tuple[tuple[str, str], ...]:
    """The config (none, else ``PRECISE_INT8_OPTION``) under which ORT's ``MatMulInteger`` is integer-exact here."""
    for entries in ((), (PRECISE_INT8_OPTION,)):
        if _int8_sums_bit_exact(entries):
            return entries
    raise QuasarError(
        "ONNX Runtime's int8 MatMulInteger is not bit-exact on this CPU, even with session.x64quantprecision=1; "
        "run W8A8 on the cpu backend (--backend cpu)"
    )


def int8_probe() -> tuple[onnx.ModelProto, np.ndarray, np.ndarray]:
    """The model ``bit_exact_int8_entries`` runs (a u8 x s8 ``MatMulInteger``), its weight and codes (pair sums past 16 bits)."""
    from onnx import TensorProto, helper, numpy_helper  # optional: onnx

    from ..exporters.onnx_versions import OPSETS, make_model  # optional: onnx

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


def _int8_sums_bit_exact(entries: tuple[tuple[str, str], ...]) -> bool:
    """Whether u8 x s8 products at the codes' extremes (255 x +-127, whose pair sums overflow 16 bits) sum exactly."""
    import onnxruntime as ort  # optional: onnxruntime

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
        import onnxruntime  # noqa: F401  (optional: is it installed?)
    except ImportError:
        return "onnxruntime is not installed (pip install onnxruntime, or onnxruntime-gpu for CUDA/TensorRT)"
    return None


def head_beside(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
    """A float lm_head as it runs beside a graph: torch's float kernel (oneDNN, packed) in the CPU's float dtype."""
    head = Linear(weight, bias, default_float_dtype("cpu"))
    head.prepare(default_float_kernel("cpu"))
    return head
