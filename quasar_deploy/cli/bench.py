"""``quasar-deploy bench``: every decoding mode side by side, and the verify-step and kernel micro-benchmarks."""

from __future__ import annotations

import json
from pathlib import Path

import click

from ..bench.e2e import MODES as MODE_NAMES
from ..errors import QuasarError


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise QuasarError(f"expected comma-separated integers, not {text!r}") from None


@click.command()
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
    from ..bench import micro
    from ..bench import report as report_writer
    from ..bench.e2e import BenchSettings, benchmark
    from ..calibration.data import BUILTIN

    if verify_step:
        result = micro.verify_step(synthetic or "qwen3-0.6b", tokens, context, repeats, progress=not as_json)
        click.echo(json.dumps(result.to_dict(), indent=2) if as_json else micro.describe_verify_step(result))
        return
    if kernels:
        result = micro.linear_kernels(synthetic or "qwen3-0.6b", repeats=repeats, progress=not as_json)
        click.echo(json.dumps(result, indent=2) if as_json else micro.describe_linear_kernels(result))
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

    from ..bench.contenders import synthetic_contenders, trained_contenders
    from ..bench.e2e import ORT_MODES

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
