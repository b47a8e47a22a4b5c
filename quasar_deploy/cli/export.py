"""``quasar-deploy export``: the artifact in the form a target runs."""

from __future__ import annotations

import click

from ..errors import QuasarError
from ..exporters import ONNX_FORMATS, TARGETS, export


@click.command("export")
@click.argument("artifact", type=click.Path(path_type=str))
@click.option("--target", required=True, type=click.Choice(list(TARGETS)), help="Target format.")
@click.option("--output", "-o", required=True, type=click.Path(path_type=str), help="New directory for the exported files.")
@click.option("--precision", type=click.Choice(["w8a8", "float"]), default="w8a8", show_default=True, help="onnx only: float = baseline.")
@click.option(
    "--format",
    "linear_format",
    type=click.Choice(ONNX_FORMATS),
    help="onnx only: integer (default; integer-exact u8xs8 MatMulInteger, for CPUs) or qdq (int8 Q/DQ for TensorRT; static artifacts).",
)
@click.option(
    "--dtype",
    type=click.Choice(["bfloat16", "float16"]),
    help="npu only: the model dtype (default bfloat16; float16 for static artifacts only).",
)
def export_command(artifact, target, output, precision, linear_format, dtype):
    """Export ARTIFACT for a target: onnx (KV-cache I/O; W8A8 linears as an integer-exact integer MatMulInteger graph,
    or as QDQ for TensorRT with --format qdq) or npu (msModelSlim layout for vLLM-Ascend)."""
    if target == "npu" and (precision != "w8a8" or linear_format is not None):
        raise QuasarError("--precision and --format apply to --target onnx only")
    if target == "onnx" and dtype is not None:
        raise QuasarError("--dtype applies to --target npu only")
    options = {"precision": precision, "linear_format": linear_format or "integer"} if target == "onnx" else {"dtype": dtype}
    click.echo(f"wrote {export(artifact, target, output, **options)}")
