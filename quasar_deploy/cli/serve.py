"""``quasar-deploy serve``: an OpenAI-compatible HTTP server on our runtime, or ``vllm serve`` with the right flags.

Heavy imports (torch, FastAPI) happen inside the command, so ``--help`` stays instant.
"""

from __future__ import annotations

from pathlib import Path

import click

from ..backends.registry import BACKENDS
from .options import exact_options, load_engine, provider_option

SERVER_DRAFTERS = ("none", "ngram", "layerskip")
# any request may ask for the layerskip drafter, so "auto" serves on a backend that runs our torch decoder
# (on a CPU: the cpu backend, which also verifies all requests' blocks in one batched forward)
SERVER_NEEDS = ("layer_skip",)


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
@click.option("--api-key", envvar="QUASAR_API_KEY", help="Require `Authorization: Bearer KEY` on all but /health [env QUASAR_API_KEY].")
@click.option("--model-name", help="The model name clients send (default: PATH's directory name).")
@click.option("--backend", default="auto", show_default=True, type=click.Choice(["auto", *BACKENDS]))
@provider_option
@click.option(
    "--draft", default="ngram", show_default=True, type=click.Choice(SERVER_DRAFTERS), help="Default drafter; a request may pick."
)
@click.option("--num-draft", "-k", default=5, show_default=True, type=click.IntRange(min=1), help="Default tokens drafted per step.")
@click.option("--max-sequences", default=8, show_default=True, type=click.IntRange(min=1), help="Requests generated at once.")
@click.option("--max-queue", default=32, show_default=True, type=click.IntRange(min=0), help="Requests waiting beyond those; then 429.")
@click.option("--max-body-bytes", default=1 << 20, show_default=True, type=click.IntRange(min=1), help="Larger request bodies get 413.")
@click.option("--chat-template", type=click.Path(exists=True, dir_okay=False, path_type=Path), help="Jinja chat template file.")
@click.option("--drain-timeout", default=300.0, show_default=True, type=click.FloatRange(min=0), help="SIGTERM: seconds to finish work.")
@click.option("--tensor-parallel-size", type=click.IntRange(min=1), help="--engine vllm only: passed to vllm serve.")
@exact_options
def serve(
    path,
    engine_name,
    host,
    port,
    api_key,
    model_name,
    backend,
    provider,
    draft,
    num_draft,
    tensor_parallel_size,
    chat_template,
    verify,
    exact_source,
    rounds,
    **limits,
):
    """Serve the model at PATH over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions)."""
    from ..errors import QuasarError

    if engine_name == "vllm":
        if verify == "exact":
            raise QuasarError("--verify exact runs on --engine quasar (vLLM serves the W8A8 model's own output)")
        from ..serve.vllm import exec_vllm, vllm_command

        exec_vllm(*vllm_command(path, host, port, api_key, model_name, draft, num_draft, tensor_parallel_size))
        return
    if tensor_parallel_size:
        raise QuasarError("--tensor-parallel-size applies to --engine vllm only")
    from ..engine import check_can_fork
    from ..exact import ExactEngine
    from ..serve.app import ServeConfig, create_app
    from ..serve.server import run

    engine = load_engine(path, backend, provider, SERVER_NEEDS, verify, exact_source, rounds)
    check_can_fork(engine.lm)
    if isinstance(engine, ExactEngine):  # every request's W8A8 rounds run on a sequence of its own
        check_can_fork(engine.middle)
    if chat_template is not None:
        engine.tokenizer.chat_template = chat_template.read_text()
    name = model_name or Path(path).resolve().name
    config = ServeConfig(name, api_key, limits["max_body_bytes"], limits["max_sequences"], limits["max_queue"], draft, num_draft)
    run(create_app(engine, config), host, port, limits["drain_timeout"])
