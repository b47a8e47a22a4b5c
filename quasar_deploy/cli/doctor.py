"""``quasar-deploy doctor``: what this machine can run."""

from __future__ import annotations

import json

import click


@click.command()
@click.argument("path", required=False, type=click.Path(path_type=str))
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@click.option("--exact", is_flag=True, help="With an artifact PATH: also the memory of --verify exact (both weight sets resident).")
@click.option("--exact-source", type=click.Path(file_okay=False, path_type=str), help="--exact: the float checkpoint (default: recorded).")
def doctor(path, as_json, exact, exact_source):
    """What this machine can run: CPU features, chosen kernels, every target; with PATH (an artifact or float
    checkpoint), the memory it needs on the cpu backend, from its tensor headers, and the backend auto picks for it."""
    from ..doctor import report
    from ..errors import QuasarError

    if (exact or exact_source) and path is None:
        raise QuasarError("--exact needs PATH, the artifact")
    if exact_source and not exact:
        raise QuasarError("--exact-source applies to --exact")
    info = report(path, exact, exact_source)
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    click.echo(f"cpu            {info['cpu']} ({info['threads']} threads)")
    click.echo(f"openmp waits   {info['omp_wait_policy']}")
    click.echo(f"isa            {' '.join(info['isa']) or 'none detected'}")
    click.echo(f"torch          {info['torch']} (python {info['python']})")
    click.echo(f"int8 kernel    {info['int8_kernel']} (exact W8A8; fbgemm {'available' if info['fbgemm'] else 'missing'})")
    click.echo(f"float kernel   {info['float_kernel']} (oneDNN {'available' if info['onednn'] else 'missing'})")
    gpu = info["gpu"]
    if "gpu" in gpu:
        cores = "int8 tensor cores usable" if gpu["int8_tensor_cores"] else "no int8 tensor cores"
        click.echo(f"gpu            {gpu['gpu']} (compute capability {gpu['compute_capability']}, {cores}; CUDA {gpu['cuda']})")
    else:
        click.echo(f"gpu            none: {gpu['reason']}")
    click.echo(
        f"backend        {info['default_backend']} for artifacts and checkpoints (--backend auto; ONNX exports: onnxruntime; "
        f"--draft layerskip and serve: {info['torch_decoder_backend']})"
    )
    click.echo("targets:")
    for name, reason in info["targets"].items():
        click.echo(f"  {name:<12} {'ready' if reason is None else 'unavailable: ' + reason}")
    if path is not None:
        click.echo(f"memory         {info['memory']['summary']}")
        click.echo(f"auto runs it   on {info['auto_backend']}")
    if exact:
        click.echo(f"exact mode     {info['exact_memory']['summary']}")
