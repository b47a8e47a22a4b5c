"""``quasar-deploy``: a thin layer over the Python API, one module per command.

A failure the user can fix is one ``error:`` line and exit code 1; commands import torch inside, so ``--help`` is instant."""

from __future__ import annotations

import sys

import click

from ..cpu.machine import prefer_passive_waits
from ..errors import QuasarError
from .bench import bench
from .cache import cache_group
from .calibrate import calibrate
from .demo import demo
from .doctor import doctor
from .evaluate import evaluate, smoothing_study
from .export import export_command
from .generate import generate
from .serve import serve


class QuasarGroup(click.Group):
    """Turns QuasarError (bad input, unusable backend) and OSError (disk, permissions) into ``error: ...`` and exit 1."""

    def invoke(self, ctx: click.Context):
        if "torch" not in sys.modules:  # OpenMP reads its wait policy once, as torch loads it
            prefer_passive_waits()
        try:
            return super().invoke(ctx)
        except (QuasarError, OSError) as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(1)


@click.group(cls=QuasarGroup)
@click.version_option(package_name="quasar-deploy")
def main() -> None:
    """Speculative decoding verified by a W8A8 (int8) copy of your model."""


for command in (calibrate, evaluate, smoothing_study, export_command, generate, serve, bench, demo, doctor, cache_group):
    main.add_command(command)

__all__ = ["main"]
