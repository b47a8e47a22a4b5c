"""``quasar-deploy doctor``: what this machine can run."""

from __future__ import annotations

import json

import click

from ..errors import QuasarError


@click.command()
@click.argument("path", required=False, type=click.Path(path_type=str))
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@click.option("--exact", is_flag=True, help="With an artifact PATH: also the memory of --verify exact (both weight sets resident).")
@click.option("--exact-source", type=click.Path(file_okay=False, path_type=str), help="--exact: the float checkpoint (default: recorded).")
def doctor(path, as_json, exact, exact_source):
    """What this machine can run: CPU features, chosen kernels, every target, and the memory and disk the demo needs;
    with PATH (an artifact or float checkpoint), the memory it needs on the cpu backend, from its tensor headers, and
    the backend auto picks for it."""
    from ..cpu.int8_linear import SUMS  # keeps --help torch-free
    from ..doctor import report  # keeps --help torch-free

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
    click.echo(f"isa listed     {' '.join(info['isa']) or 'none detected'} (/proc/cpuinfo; kernels are chosen by running them)")
    click.echo(f"torch          {info['torch']} (python {info['python']})")
    click.echo(f"int8 kernel    {info['int8_kernel']} (bit-exact W8A8; {info['probes']['int8_kernel_why']})")
    click.echo(f"float kernel   {info['float_kernel']} (oneDNN {'available' if info['onednn'] else 'missing'})")
    probes = info["probes"]
    float_why = "; ".join(filter(None, ("float models wholly, W8A8 models' lm_head", probes["float_dtype_why"], probes["bf16_rows"])))
    click.echo(f"float dtype    {probes['float_dtype']} ({float_why})")
    if probes["float_dtype"] == "float32":
        click.echo(f"16-bit floats  {probes['half_weights']}")
    int8 = "32-bit sums" if probes["fbgemm_int8_sums_32bit"] else "16-bit saturating sums: split kernel"
    ort = probes["onnxruntime_int8_options"]
    ort_text = "not installed" if ort is None else ", ".join(ort) or "bit-exact without options"
    onednn = "bit-exact" if probes["onednn_int8_bit_exact"] else "not bit-exact"
    build = probes["quasar_int8_build"]
    ours = probes["quasar_int8_why_not"] or f"runs ({build}: {SUMS[build]}; its self-check passed)"
    click.echo(f"int8 probes    fbgemm {int8}; onednn int8 {onednn}; quasar {ours}; onnxruntime {ort_text}")
    why = probes["layer_graph_attention_why"]
    how = f": {why}" if why else ", chosen by running it"
    click.echo(f"attention      {probes['layer_graph_attention']} (the cpu backend and onnxruntime's layer graphs{how})")
    gpu = info["gpu"]
    if "gpu" in gpu:
        cores = "int8 tensor cores usable" if gpu["int8_tensor_cores"] else "no int8 tensor cores"
        click.echo(f"gpu            {gpu['gpu']} (compute capability {gpu['compute_capability']}, {cores}; CUDA {gpu['cuda']})")
    else:
        click.echo(f"gpu            none: {gpu['reason']}")
    click.echo(
        f"backend        {info['artifact_backend']} for W8A8 artifacts, {info['checkpoint_backend']} for float checkpoints "
        f"(--backend auto, where memory allows; ONNX exports: onnxruntime; --draft layerskip and serve: "
        f"{info['layer_skip_backend']} and {info['layer_skip_checkpoint_backend']})"
    )
    c = info["cache"]
    click.echo(
        f"cache          {c['bytes'] / 1e9:.2f} GB in {c['entries']} entries ({c['orphaned']} orphaned), limit {c['limit'] / 1e9:.1f} GB, "
        f"at {c['path']} (quasar-deploy cache list)"
    )
    click.echo(f"demo           needs {info['demo']['summary']} (quasar-deploy demo)")
    click.echo("targets:")
    for name, reason in info["targets"].items():
        click.echo(f"  {name:<12} {'ready' if reason is None else 'unavailable: ' + reason}")
    if path is not None:
        click.echo(f"memory         {info['memory']['summary']}")
        click.echo(f"auto runs it   on {info['auto_backend']}")
    if exact:
        click.echo(f"exact mode     {info['exact_memory']['summary']}")
