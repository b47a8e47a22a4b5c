"""Option types more than one command shares, so that the same kind of value parses, and fails, the same way everywhere."""

from __future__ import annotations

import click

from ..backends.registry import candidates
from ..errors import QuasarError


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

# the suffix drafter's option, in `generate` and `bench e2e`
suffix_min_prob_option = click.option(
    "--suffix-min-prob",
    default=0.1,
    show_default=True,
    type=click.FloatRange(0, 1, max_open=True),
    help="suffix: end a draft where the estimated chance that all of it is kept falls below this.",
)
provider_option = click.option(
    "--provider",
    type=click.Choice(ONNX_PROVIDERS),
    help="onnxruntime backend only: ONNX Runtime's execution provider (cuda and tensorrt need onnxruntime-gpu; default auto).",
)


def backend_options(backend: str, provider: str | None, needs: tuple[str, ...] = ()) -> dict[str, str]:
    """The options ``api.load`` passes to the backend: ``--provider`` for onnxruntime ("auto" where it can run), else refused."""
    if provider is None:
        return {}
    name = backend if backend != "auto" or candidates(needs, ("provider",)) else candidates(needs)[0]
    if name not in ("auto", "onnxruntime"):
        raise QuasarError(f"--provider applies to the onnxruntime backend, not {name}")
    return {"provider": provider}


ENV_PREFIX = "QUASAR_"


def options_from_env(command: click.Command) -> click.Command:
    """Read every option of ``command`` from ``QUASAR_<LONG NAME>`` too (``--num-draft`` -> ``QUASAR_NUM_DRAFT``), shown in
    ``--help``, for containers; the command line wins over it, it over the default. Apply it outermost: every option gets one."""
    for param in command.params:
        if isinstance(param, click.Option):
            param.envvar = ENV_PREFIX + max(param.opts, key=len).lstrip("-").upper().replace("-", "_")
            param.show_envvar = True
    return command


def exact_options(command):
    """``--verify``, ``--exact-source`` and ``--rounds``: the choice between the model's own verification and exact mode."""
    command = click.option(
        "--rounds",
        type=click.IntRange(min=0),
        help="--verify exact: W8A8 rounds per float step, fixed (0: plain float verification of the drafts); "
        "default: chosen as it runs from the measured step costs and acceptance.",
    )(command)
    command = click.option(
        "--exact-source",
        type=click.Path(file_okay=False, path_type=str),
        help="--verify exact: the float checkpoint (default: the source the artifact records).",
    )(command)
    return click.option(
        "--verify",
        default="model",
        show_default=True,
        type=click.Choice(["model", "exact"]),
        help="model: PATH verifies (a W8A8 artifact's output is its own); exact: PATH is an artifact and the output is its "
        "float model's own, token for token (greedy) or in distribution (sampled), W8A8 drafting for it.",
    )(command)


def load_engine(
    path: str,
    backend: str,
    provider: str | None,
    needs: tuple[str, ...] = (),
    verify: str = "model",
    exact_source: str | None = None,
    rounds: int | None = None,
):
    """``api.load`` with the command line's choices; ``--exact-source`` and ``--rounds`` are refused without ``--verify exact``."""
    from ..api import load  # keeps --help torch-free

    if verify != "exact" and (exact_source is not None or rounds is not None):
        raise QuasarError(f"{'--exact-source' if exact_source is not None else '--rounds'} applies to --verify exact")
    options = backend_options(backend, provider, needs)
    engine = load(path, backend=backend, needs=needs, verify=verify, exact_source=exact_source, **options)
    if rounds is not None:
        engine.rounds = rounds
    return engine


def engine_descriptions(engine) -> dict[str, str]:
    """The verifier's backend description, and in exact mode the W8A8 model's beside it (what ``--json`` and ``--stats`` name)."""
    from ..exact_mode import ExactEngine  # keeps --help torch-free

    exact = {"middle": engine.middle.description} if isinstance(engine, ExactEngine) else {}
    return {"backend": engine.lm.description, **exact}
