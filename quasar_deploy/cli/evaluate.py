"""``quasar-deploy eval`` (fidelity of an artifact to its float model) and ``smoothing-study`` (what smoothing buys)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import click

from ..demo import demo_model_path

DATA_HELP = "Held-out text (JSONL with text/turns, or plain); repeatable, one result per set; default: built-in set."


def _sets(eval_data: tuple[str, ...]) -> dict[str, str | None]:
    return {Path(d).stem: d for d in eval_data} or {"built-in": None}


@click.command("eval")
@click.argument("artifact", type=click.Path(path_type=str))
@click.option("--reference", type=click.Path(path_type=str), help="The float checkpoint (default: the source recorded in the artifact).")
@click.option("--data", "eval_data", multiple=True, type=click.Path(dir_okay=False), help=DATA_HELP)
@click.option("--num-samples", default=32, show_default=True, type=click.IntRange(min=1))
@click.option("--seq-len", default=256, show_default=True, type=click.IntRange(min=2))
@click.option("--layers", is_flag=True, help="Also print the per-layer quantization error recorded at calibration.")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
def evaluate(artifact, reference, eval_data, num_samples, seq_len, layers, as_json):
    """Fidelity of a W8A8 ARTIFACT to its float model: top-1 agreement, KL, perplexity (per text set)."""
    from ..artifact import open_model_files  # keeps --help torch-free
    from ..fidelity import evaluate as run  # keeps --help torch-free
    from ..fidelity import reference_of  # keeps --help torch-free

    files = open_model_files(artifact)
    reference = reference or reference_of(files)
    results = {
        name: run(files.path, reference, eval_data=d, num_samples=num_samples, seq_len=seq_len, progress=not as_json).to_dict()
        for name, d in _sets(eval_data).items()
    }
    layer_errors = {name: rec["error"] for name, rec in files.manifest["layers"].items()} if layers else None
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


@click.command("smoothing-study")
@click.option("--reference", type=click.Path(path_type=str), help="Float checkpoint to study (default: demo model + outlier variant).")
@click.option("--data", "eval_data", multiple=True, type=click.Path(dir_okay=False), help=DATA_HELP)
@click.option("--num-samples", default=32, show_default=True, type=click.IntRange(min=1))
@click.option("--seq-len", default=256, show_default=True, type=click.IntRange(min=2))
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
def smoothing_study(reference, eval_data, num_samples, seq_len, as_json):
    """Calibrate with alpha off / 0.5 / auto and compare fidelity: what SmoothQuant and the alpha search buy."""
    from ..fidelity import smoothing_study as run  # keeps --help torch-free

    models = {"model": Path(reference)} if reference else {"demo": demo_model_path(), "demo-outlier": demo_model_path("outlier")}
    with tempfile.TemporaryDirectory() as work:
        study = run(models, Path(work), _sets(eval_data), num_samples=num_samples, seq_len=seq_len, progress=False)
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
