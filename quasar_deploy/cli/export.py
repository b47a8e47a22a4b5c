"""``quasar-deploy export``: the artifact in the form a target runs."""

from __future__ import annotations

import click

from ..exporters import TARGETS


@click.command("export")
@click.argument("artifact", type=click.Path(path_type=str))
@click.option("--target", required=True, type=click.Choice(list(TARGETS)), help="Target format.")
@click.option("--output", "-o", required=True, type=click.Path(path_type=str), help="New directory for the exported files.")
@click.option("--precision", type=click.Choice(["w8a8", "float"]), default="w8a8", show_default=True, help="onnx only: float = baseline.")
@click.option("--dtype", type=click.Choice(["bfloat16", "float16"]), help="npu only: the model dtype (default: the source's half type).")
def export_command(artifact, target, output, precision, dtype):
    """Export ARTIFACT for a target: onnx (exact integer MatMulInteger graph with KV-cache I/O, QDQ-free)
    or npu (msModelSlim layout for vLLM-Ascend)."""
    from ..errors import QuasarError
    from ..exporters import export

    if target == "npu" and precision != "w8a8":
        raise QuasarError("--precision float applies to --target onnx only")
    if target == "onnx" and dtype is not None:
        raise QuasarError("--dtype applies to --target npu only")
    options = {"precision": precision} if target == "onnx" else {"dtype": dtype}
    click.echo(f"wrote {export(artifact, target, output, **options)}")
