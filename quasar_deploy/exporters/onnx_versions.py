"""The versions every ONNX model we write declares: the opset of each graph form, and the IR version that goes with it.

Each the lowest the graph needs: older ONNX Runtime releases refuse the installed onnx's newer IR version."""

from __future__ import annotations

from collections.abc import Iterable

import onnx
from onnx import helper

# integer: QuantizeLinear's block_size needs opset 21; qdq stays at 18, which every TensorRT 10 parser reads
OPSETS = {"integer": 21, "qdq": 18}
IR_VERSIONS = {18: 8, 21: 10}  # the IR version each opset was released with (onnx's helper.VERSION_TABLE)
PRODUCER = "quasar-deploy"


def make_model(graph: onnx.GraphProto, opset: int, domains: Iterable[tuple[str, int]] = ()) -> onnx.ModelProto:
    """``graph`` as a model importing ``opset`` and ``domains``, declaring the IR version of ``opset``."""
    imports = [helper.make_opsetid("", opset), *(helper.make_opsetid(domain, version) for domain, version in domains)]
    return helper.make_model(graph, opset_imports=imports, ir_version=IR_VERSIONS[opset], producer_name=PRODUCER)
