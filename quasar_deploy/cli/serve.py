"""``quasar-deploy serve``: an OpenAI-compatible HTTP server on our runtime, or ``vllm serve`` with the right flags."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import click
from click.core import ParameterSource

from ..backends.registry import BACKENDS
from ..errors import QuasarError
from ..serve.needs import REQUEST_DRAFTERS, SERVER_NEEDS
from ..serve.vllm import exec_vllm, served_name, vllm_command
from .options import exact_options, load_engine, options_from_env, provider_option

# flags our engine honours and `vllm serve` has no counterpart for: refused with --engine vllm (the others are passed on)
QUASAR_ONLY = (
    "adaptive-k", "backend", "provider", "max-queue", "max-body-bytes", "max-num-draft", "max-stop", "max-stop-chars",
    "default-max-tokens", "request-timeout", "body-timeout", "kv-cache-mib", "prefill-tokens", "row-budget",
    "drain-timeout", "suffix-cache-tokens",
)  # fmt: skip
VLLM_ONLY = ("tensor-parallel-size", "vllm-arg")


def seconds_option(name: str, default: float, help: str):
    """A positive number of seconds, its default shown in --help."""
    return click.option(name, default=default, show_default=True, type=click.FloatRange(min=0, min_open=True), help=help)


@options_from_env
@click.command()
@click.argument("path", type=click.Path(path_type=str))
@click.option(
    "--engine",
    "engine_name",
    default="quasar",
    show_default=True,
    type=click.Choice(["quasar", "vllm"]),
    help="quasar: this package's runtime; vllm: exec `vllm serve` (CUDA, or vLLM-Ascend for an NPU export).",
)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (0.0.0.0 exposes the server to the network).")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535))
@click.option("--api-key", help="Require `Authorization: Bearer KEY` on all but /health.")
@click.option("--model-name", help="The model name clients send (default: PATH's directory name).")
@click.option("--backend", default="auto", show_default=True, type=click.Choice(["auto", *BACKENDS]))
@provider_option
@click.option(
    "--draft", default="ngram", show_default=True, type=click.Choice(REQUEST_DRAFTERS), help="Default drafter; a request may pick."
)
@click.option(
    "--num-draft",
    "-k",
    type=click.IntRange(min=1),
    help="Default tokens drafted per step (default: the request's drafter's own, 5 for ngram, 16 for suffix).",
)
@click.option(
    "--adaptive-k/--fixed-k",
    "adaptive_k",
    default=False,
    show_default=True,
    help="Default: each request drafts up to a k that follows its own acceptance (at most its num_draft), so rows likely "
    "rejected are not verified; a request may pick (adaptive_k).",
)
@click.option("--max-sequences", default=8, show_default=True, type=click.IntRange(min=1), help="Requests generated at once.")
@click.option("--max-queue", default=32, show_default=True, type=click.IntRange(min=0), help="Requests waiting beyond those; then 429.")
@click.option("--max-body-bytes", default=1 << 20, show_default=True, type=click.IntRange(min=1), help="Larger request bodies get 413.")
@click.option("--max-num-draft", default=16, show_default=True, type=click.IntRange(min=1), help="Largest num_draft a request may ask.")
@click.option("--max-stop", default=16, show_default=True, type=click.IntRange(min=0), help="Most stop strings in one request.")
@click.option(
    "--max-stop-chars", default=1024, show_default=True, type=click.IntRange(min=0), help="Most characters of all stop strings together."
)
@click.option("--default-max-tokens", default=1024, show_default=True, type=click.IntRange(min=1), help="max_tokens of chats naming none.")
@seconds_option("--request-timeout", 600.0, "Seconds a request may take from arrival, queueing included; then it ends with 504.")
@seconds_option("--body-timeout", 30.0, "Seconds a request's body may take to arrive; then 408.")
@click.option(
    "--kv-cache-mib",
    type=click.IntRange(min=1),
    help="KV cache all running requests may hold together; a request that does not fit gets 429 "
    "(default: half the memory available at start; on CUDA, 90% of the free device memory).",
)
@click.option(
    "--prefill-tokens",
    default=256,
    show_default=True,
    type=click.IntRange(min=1),
    help="Prompt tokens prefilled per round, beside the running requests' steps (at least one prompt or piece): more "
    "shortens a burst's wait for its first tokens and lengthens the rounds the running requests wait through.",
)
@click.option(
    "--row-budget/--all-rows",
    default=True,
    show_default=True,
    help="Batched steps compute a drafted token only where its chance of acceptance pays for its row at the step "
    "cost this server measures (docs/serving.md); --all-rows verifies every drafted token.",
)
@click.option(
    "--suffix-cache-tokens",
    default=0,
    show_default=True,
    type=click.IntRange(min=0),
    help="Keep up to this many tokens of earlier requests' outputs for suffix drafts to copy across requests (0: off). "
    "Output stays exact, but a request's speed shows whether similar text was generated for another: docs/security.md.",
)
@click.option("--chat-template", type=click.Path(exists=True, dir_okay=False, path_type=Path), help="Jinja chat template file.")
@click.option("--drain-timeout", default=300.0, show_default=True, type=click.FloatRange(min=0), help="SIGTERM: seconds to finish work.")
@click.option("--tensor-parallel-size", type=click.IntRange(min=1), help="--engine vllm only: passed to vllm serve.")
@click.option(
    "--vllm-arg",
    multiple=True,
    help="--engine vllm only: one more argument for vllm serve, passed as given (repeatable: --vllm-arg=--max-model-len --vllm-arg=4096).",
)
@exact_options
def serve(
    path, engine_name, host, port, api_key, model_name, draft, num_draft, adaptive_k, chat_template, verify, exact_source, rounds, **options
):
    """Serve the model at PATH over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions).

    Every option can also come from the environment: QUASAR_ and the option's name (QUASAR_PORT, QUASAR_NUM_DRAFT)."""
    if engine_name == "vllm":
        if verify == "exact":
            raise QuasarError("--verify exact runs on --engine quasar (vLLM serves the W8A8 model's own output)")
        return serve_with_vllm(path, host, port, api_key, model_name, draft, num_draft, chat_template, options)
    for name in VLLM_ONLY:
        if options[name.replace("-", "_")]:
            raise QuasarError(f"--{name} applies to --engine vllm only")
    from ..engine import check_can_fork  # keeps --help torch-free
    from ..exact_mode import ExactEngine  # keeps --help torch-free
    from ..serve.app import ServeConfig, create_app  # keeps --help free of torch and fastapi
    from ..serve.protocol import RequestLimits  # keeps --help torch-free
    from ..serve.scheduler import default_kv_cache_bytes  # keeps --help torch-free
    from ..serve.server import run  # keeps --help free of fastapi

    kv_cache_mib = options["kv_cache_mib"]
    limits = RequestLimits(options["max_num_draft"], options["max_stop"], options["max_stop_chars"], options["default_max_tokens"])
    config = ServeConfig(  # checked before the model loads: a bad combination of flags fails at once
        served_name(path, model_name),
        api_key=api_key,
        draft=draft,
        num_draft=num_draft,
        adaptive_k=adaptive_k,
        kv_cache_bytes=kv_cache_mib << 20 if kv_cache_mib else None,
        limits=limits,
        max_body_bytes=options["max_body_bytes"],
        max_sequences=options["max_sequences"],
        max_queue=options["max_queue"],
        request_timeout=options["request_timeout"],
        body_timeout=options["body_timeout"],
        prefill_tokens=options["prefill_tokens"],
        row_budget=options["row_budget"],
        suffix_cache_tokens=options["suffix_cache_tokens"],
    )
    engine = load_engine(path, options["backend"], options["provider"], SERVER_NEEDS, verify, exact_source, rounds)
    check_can_fork(engine.lm)
    if isinstance(engine, ExactEngine):  # every request's W8A8 rounds run on a sequence of its own
        check_can_fork(engine.middle)
    if chat_template is not None:
        engine.tokenizer.chat_template = chat_template.read_text()
    if not kv_cache_mib:  # measured once the model holds its memory
        config = dataclasses.replace(config, kv_cache_bytes=default_kv_cache_bytes(engine.lm))
    app = create_app(engine, config)
    # what serves, before uvicorn's own lines: the backend auto chose, its threads and kernels (bench serve reads it)
    click.echo(f"serving {config.model} on {engine.lm.description}", err=True)
    run(app, host, port, options["drain_timeout"])


def serve_with_vllm(path, host, port, api_key, model_name, draft, num_draft, chat_template, limits: dict) -> None:
    """Replace this process with ``vllm serve``, once no flag it cannot honour was given."""
    ctx = click.get_current_context()
    for name in QUASAR_ONLY:  # set on the command line: one line, never silently ignored
        if set_explicitly(ctx, name.replace("-", "_")):
            raise QuasarError(f"--{name} has no vLLM counterpart; drop it with --engine vllm (or pass vLLM's own with --vllm-arg)")
    # --max-sequences only when given: vLLM's scheduler, with its paged KV cache, sizes its own batch otherwise
    max_sequences = limits["max_sequences"] if set_explicitly(ctx, "max_sequences") else None
    tensor_parallel_size, extra = limits["tensor_parallel_size"], limits["vllm_arg"]
    exec_vllm(
        *vllm_command(path, host, port, api_key, model_name, draft, num_draft, tensor_parallel_size, max_sequences, chat_template, extra)
    )


def set_explicitly(ctx: click.Context, name: str) -> bool:
    """Whether option ``name`` was given (command line or environment), not left at its default."""
    return ctx.get_parameter_source(name) not in (ParameterSource.DEFAULT, None)
