"""The versions every ONNX model we write declares: the opset of each graph form, and the IR version that goes with it.

onnx's ``helper.make_model`` stamps the IR version of the installed onnx (onnx 1.23 writes IR 14), and an ONNX Runtime
refuses a model whose IR version is newer than its own release: ORT 1.21, which docker/onnxruntime-gpu pins (the
release built for its TensorRT), loads IR 10 at most. So a model states both numbers, each the lowest its graph needs:
the opset its ops need, and the IR version that opset came with. tests/test_onnx_runtimes.py loads and runs the exports
on every ONNX Runtime the project pins (the images' and the ``onnx`` extra's floor). Imports only onnx.
"""

from __future__ import annotations

from collections.abc import Iterable

import onnx
from onnx import helper

# the integer form quantizes per row with QuantizeLinear's block_size (opset 21); the qdq form stays at 18, which every
# TensorRT 10 parser reads (its ops and ReduceMean's axes input need no more)
OPSETS = {"integer": 21, "qdq": 18}
# the IR version each opset was released with (onnx's helper.VERSION_TABLE: opset 18 in onnx 1.13 with IR 8, opset 21
# in onnx 1.16 with IR 10): the lowest a model importing that opset may declare
IR_VERSIONS = {18: 8, 21: 10}
PRODUCER = "quasar-deploy"


def make_model(graph: onnx.GraphProto, opset: int, domains: Iterable[tuple[str, int]] = ()) -> onnx.ModelProto:
    """``graph`` as a model importing the default domain at ``opset`` and each ``(domain, version)`` of ``domains``
    (ORT's ``com.microsoft`` at 1 adds nothing to the IR version), declaring the IR version of ``opset``."""
    imports = [helper.make_opsetid("", opset), *(helper.make_opsetid(domain, version) for domain, version in domains)]
    return helper.make_model(graph, opset_imports=imports, ir_version=IR_VERSIONS[opset], producer_name=PRODUCER)
