"""``quasar-deploy demo``: the shipped model end to end."""

from __future__ import annotations

import click


@click.command()
@click.option("--limit", default=8, show_default=True, type=click.IntRange(min=1), help="Built-in prompts to measure.")
@click.option("--max-new-tokens", default=96, show_default=True, type=click.IntRange(min=1))
def demo(limit, max_new_tokens):
    """The shipped demo model: calibrate (cached), stream a W8A8 generation, compare n-gram on float vs W8A8."""
    from ..demo.run import describe, run_demo

    def echo(text: str) -> None:
        click.echo(text, nl=False)

    result = run_demo(echo, limit=limit, max_new_tokens=max_new_tokens)
    click.echo("\n" + describe(result))
