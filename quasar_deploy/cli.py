"""``quasar-deploy``: a thin layer over the Python API; every failure the user can fix is one line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from .artifact import open_model
from .benchmark import MODES as MODE_NAMES
from .cli_generate import generate
from .errors import QuasarError


class QuasarGroup(click.Group):
    """Turns QuasarError (bad input, unusable backend) and OSError (disk, permissions) into ``error: ...`` and exit 1."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except (QuasarError, OSError) as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(1)


@click.group(cls=QuasarGroup)
@click.version_option(package_name="quasar-deploy")
def main() -> None:
    """Speculative decoding verified by a W8A8 (int8) copy of your model."""


@main.command()
@click.argument("model_dir", type=click.Path(file_okay=False, path_type=str))
@click.option("--output", "-o", required=True, type=click.Path(path_type=str), help="New directory for the W8A8 artifact.")
@click.option("--calib-data", type=click.Path(dir_okay=False), help="JSONL (text/turns/inputs_pretokenized) or plain text.")
@click.option("--num-samples", default=64, show_default=True, type=click.IntRange(min=1))
@click.option("--seq-len", default=512, show_default=True, type=click.IntRange(min=2))
@click.option("--alpha", default="auto", show_default=True, help="'auto' (searched per group), 'off' (no smoothing) or a number in [0, 1].")
@click.option("--activation", type=click.Choice(["dynamic", "static"]), default="dynamic", show_default=True)
@click.option("--keep-float", multiple=True, help="Glob of linear layers to keep in float (repeatable), e.g. '*.down_proj'.")
@click.option("--keep-float-above", type=float, help="Also keep in float any layer whose relative error stays above this.")
@click.option("--trust-remote-code", is_flag=True, help="Allow the checkpoint's own tokenizer code to run.")
def calibrate(model_dir, output, calib_data, num_samples, seq_len, alpha, activation, keep_float, keep_float_above, trust_remote_code):
    """Calibrate MODEL_DIR (a local HF checkpoint) into a W8A8 artifact."""
    from .calibration import calibrate as run

    artifact = run(
        model_dir,
        output=output,
        calib_data=calib_data,
        num_samples=num_samples,
        seq_len=seq_len,
        alpha=alpha,
        activation=activation,
        keep_float=keep_float,
        keep_float_above=keep_float_above,
        trust_remote_code=trust_remote_code,
    )
    manifest = artifact.manifest
    click.echo(f"\n{'group':<32} {'alpha':>6} {'error before':>13} {'error after':>12}")
    for group in manifest["groups"]:
        alpha_text = "off" if group["alpha"] is None else f"{group['alpha']:.2f}"
        click.echo(f"{group['name']:<32} {alpha_text:>6} {group['error_before']:>13.3e} {group['error_after']:>12.3e}")
    kept = [name for name, layer in manifest["layers"].items() if not layer["quantized"]]
    click.echo(f"\n{len(manifest['quantized_layers'])} linear layers in W8A8, {len(kept)} kept in float (+ lm_head, embeddings)")
    click.echo(f"wrote {artifact.path}")


@main.command("eval")
@click.argument("artifact", required=False, type=click.Path(path_type=str))
@click.option("--reference", type=click.Path(path_type=str), help="The float checkpoint the artifact came from.")
@click.option(
    "--data",
    "eval_data",
    multiple=True,
    type=click.Path(dir_okay=False),
    help="Held-out text (JSONL with text/turns, or plain); repeatable, one result per set; default: built-in set.",
)
@click.option("--num-samples", default=32, show_default=True, type=click.IntRange(min=1))
@click.option("--seq-len", default=256, show_default=True, type=click.IntRange(min=2))
@click.option("--layers", is_flag=True, help="Also print the per-layer quantization error recorded at calibration.")
@click.option(
    "--smoothing-study",
    is_flag=True,
    help="Instead: calibrate with alpha off / 0.5 / auto on the demo model and its outlier variant (or --reference) and compare.",
)
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
def evaluate(artifact, reference, eval_data, num_samples, seq_len, layers, smoothing_study, as_json):
    """Fidelity of a W8A8 ARTIFACT to its float model: top-1 agreement, KL, perplexity (per text set)."""
    from .fidelity import evaluate as run

    sets = {Path(d).stem: d for d in eval_data} or {"built-in": None}
    if smoothing_study:
        return _smoothing_study(reference, sets, num_samples, seq_len, as_json)
    if not artifact or not reference:
        raise QuasarError("give ARTIFACT and --reference MODEL_DIR (or --smoothing-study)")
    results = {
        name: run(artifact, reference, eval_data=d, num_samples=num_samples, seq_len=seq_len, progress=not as_json).to_dict()
        for name, d in sets.items()
    }
    layer_errors = {name: rec["error"] for name, rec in open_model(artifact).manifest["layers"].items()} if layers else None
    if as_json:
        click.echo(json.dumps({"sets": results, "layers": layer_errors}, indent=2))
        return
    click.echo(f"{'set':<20} {'tokens':>7} {'top-1':>8} {'KL (nats)':>10} {'ppl float':>10} {'ppl W8A8':>10}")
    for name, r in results.items():
        click.echo(
            f"{name:<20} {r['tokens']:>7} {r['top1_agreement']:>8.4f} {r['mean_kl']:>10.2e} {r['ppl_float']:>10.3f} {r['ppl_w8a8']:>10.3f}"
        )
    if layer_errors:
        click.echo(f"\n{'layer':<40} {'relative error':>14}")
        for name, error in layer_errors.items():
            click.echo(f"{name:<40} {'float' if error is None else f'{error:.3e}':>14}")


def _smoothing_study(reference, sets, num_samples, seq_len, as_json):
    import tempfile

    from .demo import demo_model_path
    from .fidelity import smoothing_study

    models = {"model": Path(reference)} if reference else {"demo": demo_model_path(), "demo-outlier": demo_model_path("outlier")}
    with tempfile.TemporaryDirectory() as work:
        study = smoothing_study(models, Path(work), sets, num_samples=num_samples, seq_len=seq_len, progress=False)
    if as_json:
        click.echo(json.dumps(study, indent=2))
        return
    click.echo(f"{'model':<14} {'alpha':>6} {'set':<16} {'top-1':>8} {'KL (nats)':>10} {'ppl float':>10} {'ppl W8A8':>10}")
    for r in study["rows"]:
        click.echo(
            f"{r['model']:<14} {str(r['alpha']):>6} {r['set']:<16} {r['top1_agreement']:>8.4f} {r['mean_kl']:>10.2e} "
            f"{r['ppl_float']:>10.3f} {r['ppl_w8a8']:>10.3f}"
        )
    click.echo("\nmean per-layer relative error:")
    for name, errors in study["layers"].items():
        values = [e for e in errors.values() if e is not None]
        click.echo(f"  {name:<28} {sum(values) / max(1, len(values)):.3e}")


@main.command("export")
@click.argument("artifact", type=click.Path(path_type=str))
@click.option("--target", required=True, type=click.Choice(["onnx", "npu"]), help="Target format.")
@click.option("--output", "-o", required=True, type=click.Path(path_type=str), help="New directory for the exported files.")
@click.option("--precision", type=click.Choice(["w8a8", "float"]), default="w8a8", show_default=True, help="onnx only: float = baseline.")
def export_command(artifact, target, output, precision):
    """Export a W8A8 ARTIFACT for a target: onnx (QDQ graph + KV cache) or npu (msModelSlim layout for vLLM-Ascend)."""
    from .export import export

    options = {"precision": precision} if target == "onnx" else {}
    if target == "npu" and precision != "w8a8":
        raise QuasarError("--precision float applies to --target onnx only")
    click.echo(f"wrote {export(artifact, target, output, **options)}")


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise QuasarError(f"expected comma-separated integers, not {text!r}") from None


@main.command()
@click.argument("model", required=False, type=click.Path(path_type=str))
@click.argument("artifact", required=False, type=click.Path(path_type=str))
@click.option("--synthetic", help="Instead of MODEL/ARTIFACT: random weights of a published shape (timing only), e.g. qwen3-0.6b.")
@click.option("--prompts", type=click.Path(dir_okay=False), help="Spec-Bench JSONL (turns[0] is the prompt); default: built-in.")
@click.option("--limit", default=10, show_default=True, type=click.IntRange(min=1))
@click.option("--max-new-tokens", default=128, show_default=True, type=click.IntRange(min=1))
@click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(min=0))
@click.option("--num-draft", default=5, show_default=True, type=click.IntRange(min=1))
@click.option("--ngram-min", default=1, show_default=True, type=click.IntRange(min=1))
@click.option("--ngram-max", default=3, show_default=True, type=click.IntRange(min=1))
@click.option("--modes", help="Comma-separated subset of: " + ", ".join(MODE_NAMES) + " (default: all).")
@click.option("--sweep-k", help="Comma-separated draft lengths: also measure ngram-w8a8 vs ngram-float per k.")
@click.option("--out", default="bench-out", show_default=True, type=click.Path(file_okay=False), help="Report directory.")
@click.option("--verify-step", is_flag=True, help="Only time one verify forward (k+1 tokens, warm cache), float vs W8A8, on --synthetic.")
@click.option("--kernels", is_flag=True, help="Only time the linear kernels at decode/verify shapes against the memory bandwidth.")
@click.option("--tokens", default=6, show_default=True, type=click.IntRange(min=1), help="--verify-step: tokens per step (k+1).")
@click.option("--context", default=128, show_default=True, type=click.IntRange(min=1), help="--verify-step: tokens in the cache.")
@click.option("--repeats", default=20, show_default=True, type=click.IntRange(min=1), help="--verify-step/--kernels: timed repeats.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def bench(
    model,
    artifact,
    synthetic,
    prompts,
    limit,
    max_new_tokens,
    temperature,
    num_draft,
    ngram_min,
    ngram_max,
    modes,
    sweep_k,
    out,
    verify_step,
    kernels,
    tokens,
    context,
    repeats,
    as_json,
):
    """Measure decoding modes side by side (float vs W8A8, n-gram, layer-skip, HF prompt lookup, pruned verifier)."""
    from . import bench as micro
    from . import report as report_writer
    from .benchmark import BenchSettings, benchmark
    from .calibration.data import BUILTIN

    if verify_step:
        result = micro.verify_step(synthetic or "qwen3-0.6b", tokens, context, repeats, progress=not as_json)
        click.echo(json.dumps(result.to_dict(), indent=2) if as_json else micro.describe_verify_step(result))
        return
    if kernels:
        result = micro.kernels(synthetic or "qwen3-0.6b", repeats=repeats, progress=not as_json)
        click.echo(json.dumps(result, indent=2) if as_json else micro.describe_kernels(result))
        return
    if synthetic and (model or artifact):
        raise QuasarError("give MODEL and ARTIFACT, or --synthetic, not both")
    if not synthetic and not (model and artifact):
        raise QuasarError("give MODEL (float checkpoint) and ARTIFACT (its W8A8 artifact), or --synthetic SHAPE")
    settings = BenchSettings(
        prompts=str(prompts or BUILTIN["prompts"]),
        model=model,
        artifact=artifact,
        synthetic=synthetic,
        limit=limit,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        num_draft=num_draft,
        ngram_min=ngram_min,
        ngram_max=ngram_max,
        modes=tuple(m.strip() for m in modes.split(",")) if modes else MODE_NAMES,
        sweep_k=_int_list(sweep_k) if sweep_k else (),
    )
    import tempfile

    from .benchmark import ORT_MODES
    from .contenders import synthetic_contenders, trained_contenders

    with_hf = "hf-prompt-lookup" in settings.modes
    with tempfile.TemporaryDirectory() as work:
        with_ort = Path(work) if set(ORT_MODES) & set(settings.modes) else None
        contenders = synthetic_contenders(synthetic, with_hf) if synthetic else trained_contenders(model, artifact, with_hf, with_ort)
        result = benchmark(settings, contenders, progress=not as_json)
    written = report_writer.write(result, out)
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    click.echo(report_writer.markdown(result))
    click.echo("wrote " + ", ".join(str(p) for p in written))


@main.command()
@click.option("--limit", default=8, show_default=True, type=click.IntRange(min=1), help="Built-in prompts to measure.")
@click.option("--max-new-tokens", default=96, show_default=True, type=click.IntRange(min=1))
def demo(limit, max_new_tokens):
    """The shipped demo model: calibrate (cached), stream a W8A8 generation, compare n-gram on float vs W8A8."""
    from .demo_run import describe, run_demo

    def echo(text: str) -> None:
        click.echo(text, nl=False)

    result = run_demo(echo, limit=limit, max_new_tokens=max_new_tokens)
    click.echo("\n" + describe(result))


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
def doctor(as_json):
    """What this machine can run: CPU features, chosen kernels, every target."""
    from .doctor import report

    info = report()
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    click.echo(f"cpu            {info['cpu']} ({info['threads']} threads)")
    click.echo(f"isa            {' '.join(info['isa']) or 'none detected'}")
    click.echo(f"torch          {info['torch']} (python {info['python']})")
    click.echo(f"int8 kernel    {info['int8_kernel']} (exact W8A8; fbgemm {'available' if info['fbgemm'] else 'missing'})")
    click.echo(f"float kernel   {info['float_kernel']} (oneDNN {'available' if info['onednn'] else 'missing'})")
    click.echo("targets:")
    for name, reason in info["targets"].items():
        click.echo(f"  {name:<12} {'ready' if reason is None else 'unavailable: ' + reason}")


main.add_command(generate)

if __name__ == "__main__":
    main()
