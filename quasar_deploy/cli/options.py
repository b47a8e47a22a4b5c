"""Option types more than one command shares, so that the same kind of value parses, and fails, the same way everywhere."""

from __future__ import annotations

import click


class IntList(click.ParamType):
    """``"1,2,3"`` -> ``(1, 2, 3)``; anything else is click's usual "Invalid value for '--option'" usage error."""

    name = "INTS"

    def convert(self, value: object, param: click.Parameter | None, ctx: click.Context | None) -> tuple[int, ...]:
        if isinstance(value, tuple):
            return value
        try:
            return tuple(int(v) for v in str(value).split(",") if v.strip())
        except ValueError:
            self.fail(f"expected comma-separated integers, not {value!r}", param, ctx)


INT_LIST = IntList()


# backends/onnxruntime.PROVIDERS with "auto" (named here so that --help imports no torch; a test keeps them equal)
ONNX_PROVIDERS = ("auto", "cpu", "cuda", "tensorrt")

provider_option = click.option(
    "--provider",
    type=click.Choice(ONNX_PROVIDERS),
    help="onnxruntime backend only: ONNX Runtime's execution provider (cuda and tensorrt need onnxruntime-gpu; default auto).",
)


def backend_options(path: str, backend: str, provider: str | None, needs: tuple[str, ...] = ()) -> dict[str, str]:
    """The options ``engine.load`` passes to the backend: ``--provider`` goes to onnxruntime (named, or what "auto" picks)
    and is refused for any other backend, in one line."""
    if provider is None:
        return {}
    from ..backends.registry import resolve_backend
    from ..errors import QuasarError

    name = resolve_backend(backend, path, needs)
    if name != "onnxruntime":
        raise QuasarError(f"--provider applies to the onnxruntime backend, not {name}")
    return {"provider": provider}


ENV_PREFIX = "QUASAR_"


def options_from_env(command: click.Command) -> click.Command:
    """Read every option of ``command`` from ``QUASAR_<LONG NAME>`` too (``--num-draft`` -> ``QUASAR_NUM_DRAFT``), shown in
    ``--help``: a container is configured through its environment (``docker run -e``, compose) instead of a rewritten
    command line. The command line wins over the environment, the environment over the default. Applied to the finished
    command (the outermost decorator), so every option it has, now or added later, gets its variable."""
    for param in command.params:
        if isinstance(param, click.Option):
            param.envvar = ENV_PREFIX + max(param.opts, key=len).lstrip("-").upper().replace("-", "_")
            param.show_envvar = True
    return command
