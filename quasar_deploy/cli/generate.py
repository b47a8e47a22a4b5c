"""``quasar-deploy generate``: one completion from the command line, streamed as the verifier accepts it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from ..backends.registry import BACKENDS, draft_needs
from ..errors import QuasarError
from ..speculative.registry import DRAFTERS
from .options import engine_descriptions, exact_options, load_engine, provider_option, suffix_min_prob_option


def _layers(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise QuasarError(f"--skip-layers takes comma-separated layer numbers, e.g. 2,3; got {text!r}") from None


def _prompt(prompt: str | None, prompt_file: str | None, chat: bool) -> str | list[dict[str, str]]:
    if (prompt is None) == (prompt_file is None):
        raise QuasarError("give the prompt with exactly one of --prompt or --prompt-file")
    if prompt_file is not None:
        try:
            prompt = sys.stdin.read() if prompt_file == "-" else Path(prompt_file).read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise QuasarError(f"{prompt_file}: cannot read the prompt ({exc})") from None
    return [{"role": "user", "content": prompt}] if chat else prompt


def _memory(paths: list[str], backend: str, result) -> dict:
    """What this process holds now, next to the cpu backend's estimate for the models at ``paths`` at this length."""
    from ..artifact import open_model_files  # keeps --help torch-free
    from ..memory import MIB, estimate, resident  # keeps --help torch-free

    measured = resident()
    if backend != "cpu":  # ONNX Runtime and the devices hold their weights their own way
        return measured
    tokens = result.prompt_tokens + len(result.tokens)
    return {**measured, "estimated_mib": sum(estimate(open_model_files(p)).total(tokens) for p in paths) / MIB}


@click.command()
@click.argument("path", type=click.Path(path_type=str))
@click.option("--prompt", help="The prompt text.")
@click.option("--prompt-file", type=click.Path(dir_okay=False, path_type=str), help="Read the prompt from a file ('-': stdin).")
@click.option("--chat", is_flag=True, help="Send the prompt as one user message through the tokenizer's chat template.")
@click.option("--max-new-tokens", default=256, show_default=True, type=click.IntRange(min=1))
@click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(min=0), help="0: greedy.")
@click.option("--top-p", default=1.0, show_default=True, type=click.FloatRange(0, 1, min_open=True))
@click.option("--top-k", default=0, show_default=True, type=click.IntRange(min=0), help="0: off.")
@click.option("--seed", type=click.IntRange(0, 2**64 - 1), help="Seed for sampling (default: a fresh one).")
@click.option(
    "--draft",
    default="ngram",
    show_default=True,
    type=click.Choice(list(DRAFTERS)),
    help="Drafter: " + "; ".join(f"{name}: {entry.help}" for name, entry in DRAFTERS.items()) + ".",
)
@click.option(
    "--num-draft",
    "-k",
    type=click.IntRange(min=1),
    help="Tokens drafted per verify step (plain: --draft none); with --adaptive-k the most. Default: the drafter's own, 5 "
    "(the paper's) for ngram, 16 for suffix, whose drafts stop where its counts say.",
)
@click.option(
    "--adaptive-k/--fixed-k",
    "adaptive_k",
    default=False,
    show_default=True,
    help="Draft up to a k that follows the acceptance of recent steps (at most --num-draft), or always --num-draft.",
)
@click.option("--ngram-min", default=1, show_default=True, type=click.IntRange(min=1))
@click.option("--ngram-max", default=3, show_default=True, type=click.IntRange(min=1))
@suffix_min_prob_option
@click.option("--skip-layers", help="layerskip: comma-separated layers to skip, e.g. 2,3.")
@click.option(
    "--skip-fraction",
    type=click.FloatRange(0, 1, min_open=True, max_open=True),
    help="layerskip: fraction of layers to skip, chosen by top-1 agreement (default 0.5).",
)
@click.option("--draft-model", type=click.Path(path_type=str), help="model: path of a small draft model with the same tokenizer.")
@click.option("--stop", multiple=True, help="Stop string (repeatable); the text ends before it.")
@click.option("--backend", default="auto", show_default=True, type=click.Choice(["auto", *BACKENDS]))
@provider_option
@exact_options
@click.option("--stats", "show_stats", is_flag=True, help="Print speed and acceptance statistics (to stderr).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (text, tokens, finish_reason, stats) instead of streaming.")
def generate(path, prompt, prompt_file, chat, backend, provider, verify, exact_source, rounds, show_stats, as_json, skip_layers, **options):
    """Generate a completion with the model at PATH (W8A8 artifact or Hugging Face checkpoint; --verify exact: an
    artifact, whose float model's own output is generated)."""
    text = _prompt(prompt, prompt_file, chat)
    engine = load_engine(path, backend, provider, draft_needs(options["draft"]), verify, exact_source, rounds)
    stream = engine.stream(text, skip_layers=_layers(skip_layers), **options)
    if as_json:
        for _ in stream:
            pass
    else:
        try:
            for piece in stream:
                click.echo(piece, nl=False)
        finally:
            click.echo()  # ends the text's line, also when an error cuts it short, so the error gets a line of its own
    result = stream.result
    if result.context_full:
        click.echo(
            f"warning: the context window ({result.prompt_tokens + len(result.tokens)} tokens) ended the generation "
            f"after {len(result.tokens)} of {options['max_new_tokens']} new tokens",
            err=True,
        )
    models = engine_descriptions(engine)
    if as_json:
        click.echo(json.dumps({**result.to_dict(), **models}))
    elif show_stats:
        memory = _memory([path, *([str(engine.source)] if verify == "exact" else [])], engine.backend, result)
        for name, value in {**models, "finish_reason": result.finish_reason, **result.stats.to_dict(), **memory}.items():
            click.echo(f"{name:>18}: {value:.4g}" if isinstance(value, float) else f"{name:>18}: {value}", err=True)
