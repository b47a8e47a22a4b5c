"""``quasar-deploy demo``: the shipped model, and its inflation to the Qwen3-0.6B body, end to end."""

from __future__ import annotations

import click

from ..demo import DEFAULT_LIMIT, DEFAULT_MAX_NEW_TOKENS


@click.command()
@click.option("--limit", default=DEFAULT_LIMIT, show_default=True, type=click.IntRange(min=1), help="Built-in prompts to measure.")
@click.option("--max-new-tokens", default=DEFAULT_MAX_NEW_TOKENS, show_default=True, type=click.IntRange(min=1))
def demo(limit, max_new_tokens):
    """The demo model inflated to the Qwen3-0.6B body (same outputs, a 0.6B body's bytes per step) and the demo model itself:
    calibrate and inflate (cached), stream a W8A8 generation, measure n-gram on float vs W8A8 verifiers end to end."""
    from ..demo.run import describe, run_demo  # keeps --help torch-free

    def echo(text: str) -> None:
        click.echo(text, nl=False)

    result = run_demo(echo, limit=limit, max_new_tokens=max_new_tokens)
    click.echo("\n" + describe(result))
