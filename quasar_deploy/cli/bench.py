"""``quasar-deploy bench e2e|serve|first-call|verify-step|roofline|kernels|onnx|gpu``: every speed figure the docs quote, one
subcommand per measurement, each printing its result record with ``--json`` (``bench.record``); ``report``: the benchmarks
page from those records; ``write-checkpoint``: a real-size random checkpoint to measure calibration and loading on."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

import click

from ..backends.registry import BACKENDS
from ..bench import report as report_writer
from ..bench.anchors import pythons
from ..bench.gpu_settings import DEFAULT_ROWS, DEFAULT_SHAPES, GpuSettings
from ..bench.modes import ALL_MODES, ORT_MODES
from ..bench.record import INT8, make_record, read_records, render
from ..errors import QuasarError
from ..files import require_new
from ..speculative.registry import DRAFTERS
from .options import INT_LIST, suffix_min_prob_option

# option decorators the subcommands share (each use makes its own click.Option)
shape_option = click.option(
    "--synthetic", "shape", default="qwen3-0.6b", show_default=True, metavar="SHAPE", help="Published shape, random weights (timing only)."
)
json_option = click.option("--json", "as_json", is_flag=True, help="Print the result record as JSON (bench/results/, `bench report`).")
threads_option = click.option("--threads", default=2, show_default=True, type=click.IntRange(min=1), help="ONNX Runtime intra-op threads.")
onnx_repeats_option = click.option("--repeats", default=10, show_default=True, type=click.IntRange(min=1), help="Timed calls (median).")


@click.group()
def bench() -> None:
    """Measure speed: decoding modes end to end, the server under load, one verify step, the linear kernels, the exported ONNX
    forms; write test checkpoints."""


@bench.command("e2e")
@click.argument("artifact", required=False, type=click.Path(path_type=str))
@click.option("--reference", type=click.Path(path_type=str), help="The float checkpoint (default: the source recorded in the artifact).")
@click.option(
    "--synthetic", metavar="SHAPE", help="Instead of ARTIFACT: random weights of a published shape (timing only), e.g. qwen3-0.6b."
)
@click.option("--prompts", type=click.Path(dir_okay=False), help="Spec-Bench JSONL (turns[0] is the prompt); default: built-in.")
@click.option("--limit", default=10, show_default=True, type=click.IntRange(min=1))
@click.option(
    "--repeats",
    default=1,
    show_default=True,
    type=click.IntRange(min=1),
    help="Runs of each mode on each prompt, interleaved; a prompt's figure is its median run (steadier ratios on a noisy machine).",
)
@click.option("--max-new-tokens", default=128, show_default=True, type=click.IntRange(min=1))
@click.option("--temperature", default=0.0, show_default=True, type=click.FloatRange(min=0))
@click.option("--num-draft", type=click.IntRange(min=1), help="k for every drafter (default: each drafter's own: ngram 5, suffix 16).")
@click.option("--ngram-min", default=1, show_default=True, type=click.IntRange(min=1))
@click.option("--ngram-max", default=3, show_default=True, type=click.IntRange(min=1))
@suffix_min_prob_option
@click.option("--modes", help="Comma-separated subset of: " + ", ".join(ALL_MODES) + " (default: all).")
@click.option("--sweep-k", type=INT_LIST, help="Comma-separated draft lengths: also measure ngram-w8a8 vs ngram-float per k.")
@click.option(
    "--anchor-python",
    "anchor_pythons",
    multiple=True,
    metavar="ENGINE=PYTHON",
    help="The python of the venv holding an anchor engine (llamacpp, vllm); default $QUASAR_LLAMACPP_PYTHON, "
    "$QUASAR_VLLM_PYTHON. Unset: that engine's modes are skipped with the reason (docs/anchors.md).",
)
@click.option("-o", "--output", default="bench-out", show_default=True, type=click.Path(file_okay=False), help="Report directory.")
@json_option
def e2e(artifact, reference, synthetic, prompts, modes, sweep_k, anchor_pythons, output, as_json, **options):
    """Every decoding mode on the same prompts, interleaved prompt by prompt (float vs W8A8 verifier, n-gram, layer-skip...)."""
    from ..artifact import open_model_files  # keeps --help torch-free
    from ..bench.contenders import synthetic_contenders, trained_contenders  # keeps --help torch-free
    from ..bench.e2e import BenchSettings, benchmark  # keeps --help torch-free
    from ..calibration.data import BUILTIN  # keeps --help torch-free
    from ..fidelity import reference_of  # keeps --help torch-free

    report_writer.pyplot()  # refused now rather than after the run
    if synthetic and (artifact or reference):
        raise QuasarError("give ARTIFACT (and --reference) or --synthetic, not both")
    if not synthetic and not artifact:
        raise QuasarError("give ARTIFACT (a W8A8 artifact; --reference MODEL_DIR for its float checkpoint) or --synthetic SHAPE")
    if artifact:
        reference = reference or str(reference_of(open_model_files(artifact)))
    settings = BenchSettings(
        prompts=str(prompts or BUILTIN["prompts"]),
        model=reference,
        artifact=artifact,
        synthetic=synthetic,
        modes=tuple(m.strip() for m in modes.split(",")) if modes else ALL_MODES,
        sweep_k=sweep_k or (),
        anchor_pythons=_engine_paths(anchor_pythons),
        **options,  # the other options are the settings' fields by name (limit, repeats, ..., suffix_min_prob)
    )
    with_hf = "hf-prompt-lookup" in settings.modes
    with tempfile.TemporaryDirectory() as work:
        with_ort = Path(work) if set(ORT_MODES) & set(settings.modes) else None
        contenders = synthetic_contenders(synthetic, with_hf) if synthetic else trained_contenders(reference, artifact, with_hf, with_ort)
        result = benchmark(settings, contenders, progress=not as_json)
    dtypes = _float_vs_int8(head_stored=_head_stored(None if synthetic else artifact))
    _show(result, report_writer.write(result, output), report_writer.markdown, as_json, dtypes)


def _engine_paths(pairs: tuple[str, ...]) -> dict[str, str]:
    """``("vllm=/v/bin/python",)`` -> each engine's python, the environment's where not given; bad pairs refused in one line."""
    paths = {}
    for pair in pairs:
        engine, sep, path = pair.partition("=")
        if not sep or not engine.strip() or not path:
            raise QuasarError(f"--anchor-python takes ENGINE=PYTHON, not {pair!r}")
        paths[engine.strip()] = path
    return pythons(paths)


def _show(report: dict, written: list[Path], markdown: Callable[[dict], str], as_json: bool, dtypes: dict[str, str]) -> None:
    """A written report on stdout: as a JSON record, or as its markdown table and the files written."""
    _emit(report, lambda: markdown(report) + "\nwrote " + ", ".join(str(p) for p in written), as_json, dtypes)


def _emit(figures: dict, text: Callable[[], str], as_json: bool, dtypes: dict[str, str]) -> None:
    """A result on stdout: the record of this command (``bench.record``) with ``--json``, else ``text()``."""
    if not as_json:
        click.echo(text())
        return

    ctx = click.get_current_context()
    command = ctx.command_path.split(" ", 1)[1]  # "bench verify-step", whatever the program is called
    options = {name: value for name, value in ctx.params.items() if name not in ("as_json", "output")}  # not what was measured
    click.echo(json.dumps(make_record(command, options, dtypes, figures), indent=2, default=str))


def _float_vs_int8(int8_lm_head: bool = False, head_stored: str = "BF16", head_dtype: str | None = None) -> dict[str, str]:
    """What the float and W8A8 contenders compute in here: the CPU's float dtype, also the W8A8 float lm_head's."""
    from ..cpu.linears import FLOAT_DTYPES, default_float_dtype, dtype_name, half_weights  # keeps --help torch-free
    from ..shards import TORCH_DTYPES  # keeps --help torch-free

    dtype = dtype_name(default_float_dtype("cpu"))
    head_dtype = head_dtype or dtype
    half = half_weights(TORCH_DTYPES[head_stored], FLOAT_DTYPES[head_dtype], "onednn")
    head = f"{head_dtype} lm_head{' over 16-bit weights (quasar-half)' if half else ''}"
    return {"float": dtype, "w8a8": f"{INT8}, {'int8 lm_head' if int8_lm_head else head}"}


def _head_stored(path: str | None) -> str:
    """The safetensors dtype name of the lm_head (or its tied table) of the model at ``path``; None: a synthetic shape's."""
    if path is None:
        return "BF16"
    from ..artifact import open_model_files  # keeps --help torch-free
    from ..memory import head_dtype_name  # keeps --help torch-free

    return head_dtype_name(open_model_files(path).checkpoint.dtypes)


def _dtypes_of(path: str) -> dict[str, str]:
    """What a run of the model at ``path`` computes in: an artifact's W8A8, or a float checkpoint's float dtype."""
    from ..artifact import open_model_files  # keeps --help torch-free
    from ..memory import head_dtype_name  # keeps --help torch-free

    files = open_model_files(path)  # opened (and its files verified) once
    dtypes = _float_vs_int8(head_stored=head_dtype_name(files.checkpoint.dtypes))
    return {"w8a8": dtypes["w8a8"]} if files.is_artifact else {"float": dtypes["float"]}


@bench.command("roofline")
@click.argument("path", type=click.Path(path_type=str))
@click.option("--prompt", default="def fibonacci(n):\n", show_default=True, help="The prompt.")
@click.option("--max-new-tokens", default=32, show_default=True, type=click.IntRange(min=1))
@click.option("--draft", default="ngram", show_default=True, type=click.Choice(list(DRAFTERS)), help="Drafter (see generate --draft).")
@click.option("--num-draft", "-k", default=5, show_default=True, type=click.IntRange(min=1))
@json_option
def roofline_command(path, prompt, max_new_tokens, draft, num_draft, as_json):
    """One generation of PATH (artifact or float checkpoint) on the cpu backend against the memory-bandwidth bound:
    bytes each verify step reads / copy bandwidth, both measured in this run."""
    from ..bench.roofline import describe_roofline, roofline  # keeps --help torch-free

    result = roofline(path, prompt, max_new_tokens, draft, num_draft)
    _emit(result.to_dict(), lambda: describe_roofline(result), as_json, _dtypes_of(path))


@bench.command("first-call")
@click.argument("path", type=click.Path(path_type=str))
@click.option("--backend", default="auto", show_default=True, type=click.Choice(["auto", *BACKENDS]))
@click.option(
    "--draft",
    default="ngram",
    show_default=True,
    type=click.Choice([d for d in DRAFTERS if d != "model"]),
    help="Drafter (see generate --draft).",
)
@click.option("--num-draft", "-k", default=5, show_default=True, type=click.IntRange(min=1))
@click.option("--max-new-tokens", default=128, show_default=True, type=click.IntRange(min=1))
@click.option("--calls", default=3, show_default=True, type=click.IntRange(min=2), help="Generations of the same prompt(s) after one load.")
@click.option("--prompts", type=click.Path(dir_okay=False), help="Spec-Bench JSONL (turns[0] is the prompt); default: built-in.")
@click.option("--limit", default=1, show_default=True, type=click.IntRange(min=1), help="Prompts per call.")
@json_option
def first_call_command(path, backend, draft, num_draft, max_new_tokens, calls, prompts, limit, as_json):
    """PATH loaded once (warm-up included in the load time), then generated CALLS times on the same prompt(s): each call's
    decode tok/s and the first call as a share of the median of the rest (load's warm-up should make it the steady state)."""
    from ..bench.first_call import describe_first_call, first_call  # keeps --help torch-free

    result = first_call(path, backend, draft, num_draft, max_new_tokens, calls, prompts, limit)
    _emit(result.to_dict(), lambda: describe_first_call(result), as_json, _dtypes_of(path))


@bench.command("serve")
@click.argument("artifact", required=False, type=click.Path(path_type=str))
@click.option("--synthetic", metavar="SHAPE", help="Instead of ARTIFACT: W8A8 random weights of a published shape (timing only).")
@click.option("--prompts", type=click.Path(dir_okay=False), help="Spec-Bench JSONL (turns[0] is the prompt); default: built-in.")
@click.option("--limit", default=16, show_default=True, type=click.IntRange(min=1), help="Prompts, each sent once per level.")
@click.option("--concurrency", default="1,4,8", show_default=True, type=INT_LIST, help="Comma-separated numbers of clients.")
@click.option("--max-tokens", default=128, show_default=True, type=click.IntRange(min=1))
@click.option("--draft", default="ngram", show_default=True, type=click.Choice(["none", "ngram", "suffix", "layerskip"]))
@click.option("--num-draft", type=click.IntRange(min=1), help="Our server's --num-draft (default: each request's drafter's own).")
@click.option(
    "--compare",
    default="",
    help="Comma-separated drafting variants run through the same server after --draft, its requests asking for them: a "
    "drafter, or a drafter with -adaptive for a k per sequence (e.g. suffix,ngram-adaptive,suffix-adaptive).",
)
@click.option(
    "--rounds",
    default=1,
    show_default=True,
    type=click.IntRange(min=1),
    help="Runs of --draft and each --compare variant, interleaved in an order rotated each round; a level's figure is "
    "its median run (steadier comparisons on a noisy machine).",
)
@click.option(
    "--backend",
    default="auto",
    show_default=True,
    type=click.Choice(["auto", *BACKENDS]),
    help="What `quasar-deploy serve --backend` gets (an ARTIFACT only; auto: what a deployment gets).",
)
@click.option("--prefill-tokens", default=256, show_default=True, type=click.IntRange(min=1), help="Our server's `serve --prefill-tokens`.")
@click.option("--row-budget/--all-rows", default=True, show_default=True, help="Our server's `serve --row-budget/--all-rows`.")
@click.option("-o", "--output", default="bench-serve", show_default=True, type=click.Path(file_okay=False), help="New report directory.")
@click.option(
    "--vllm-python",
    type=click.Path(dir_okay=False, path_type=Path),
    envvar="QUASAR_VLLM_PYTHON",
    help="Then vLLM's CPU build serves ARTIFACT the same way, compared level by level: the python of its venv (docs/anchors.md).",
)
@json_option
def serve(artifact, synthetic, prompts, compare, output, vllm_python, as_json, **options):
    """Our server on 127.0.0.1 under streaming clients at each concurrency: tokens/s, TTFT, inter-token latency, acceptance;
    with --vllm-python, vLLM's OpenAI server on the same artifact after it.

    ARTIFACT defaults to the demo model's W8A8 artifact (calibrated once, cached).
    """
    from ..bench import serving  # keeps --help free of torch and fastapi
    from ..calibration.data import BUILTIN  # keeps --help torch-free

    if synthetic and artifact:
        raise QuasarError("give ARTIFACT or --synthetic, not both")
    require_new(output)
    prompts = str(prompts or BUILTIN["prompts"])
    if synthetic and options["backend"] != "auto":
        raise QuasarError("--backend applies to an ARTIFACT (a synthetic model is served on the cpu backend)")
    variants = tuple(v.strip() for v in compare.split(",") if v.strip())
    # the other options are the settings' fields by name (limit, concurrency, ..., row_budget)
    settings = serving.ServeBenchSettings(prompts, artifact=artifact, synthetic=synthetic, compare=variants, **options)
    report = serving.benchmark_serving(settings, progress=not as_json, vllm_python=vllm_python)
    w8a8 = _float_vs_int8(head_stored=_head_stored(None if synthetic else artifact))["w8a8"]
    _show(report, serving.write(report, output), serving.markdown, as_json, {"w8a8": w8a8})


@bench.command("batched-step")
@click.argument("artifact", type=click.Path(path_type=str))
@click.option("--sequences", default="1,8", show_default=True, type=INT_LIST, help="Sequences per step, comma-separated.")
@click.option("--tokens", default=6, show_default=True, type=click.IntRange(min=1), help="Rows per sequence (k+1).")
@click.option("--context", default=150, show_default=True, type=click.IntRange(min=1), help="Tokens in each sequence's cache.")
@click.option("--repeats", default=10, show_default=True, type=click.IntRange(min=1), help="Timed steps per backend and count.")
@click.option(
    "--prefill",
    default=256,
    show_default=True,
    type=click.IntRange(min=0, max=256),
    help="Also time a fresh sequence's prefill of this many prompt tokens (a server round's piece, at most 256); 0: not.",
)
@click.option(
    "--backends",
    default="cpu,onnxruntime",
    show_default=True,
    help="Comma-separated backends that batch a server's steps (each as `serve --backend` loads it); onnxruntime-gqa: the "
    "layer graphs with ORT's attention instead of the C kernel.",
)
@json_option
def batched_step(artifact, sequences, tokens, context, repeats, prefill, backends, as_json):
    """A serving step, N sequences' verify blocks in one forward, on each backend that batches: its cost at each N."""
    from ..bench.batched_step import CONTENDERS, describe  # keeps --help torch-free
    from ..bench.batched_step import batched_step as measure  # keeps --help torch-free

    names = tuple(b.strip() for b in backends.split(",") if b.strip())
    if not names or any(b not in CONTENDERS for b in names):
        raise QuasarError(f"--backends takes names of {', '.join(CONTENDERS)}, not {backends!r}")
    if not sequences or min(sequences) < 1:
        raise QuasarError("--sequences takes integers >= 1, e.g. 1,8")
    result = measure(artifact, sequences, tokens, context, repeats, names, progress=not as_json, prefill=prefill)
    _emit(result.to_dict(), lambda: describe(result), as_json, _dtypes_of(artifact))


@bench.command("verify-step")
@shape_option
@click.option("--tokens", default=6, show_default=True, type=click.IntRange(min=1), help="Tokens per step (k+1).")
@click.option("--context", default=128, show_default=True, type=click.IntRange(min=1), help="Tokens in the cache.")
@click.option("--repeats", default=20, show_default=True, type=click.IntRange(min=1), help="Timed pairs.")
@click.option("--int8-kernel", help="reference, fbgemm, fbgemm-vnni, onednn-vnni or quasar (default: the fastest bit-exact one here).")
@click.option("--int8-lm-head", is_flag=True, help="The W8A8 twin's lm_head in int8 too (as `calibrate --int8-lm-head` makes it).")
@click.option(
    "--float-dtype",
    "float_dtypes",
    multiple=True,
    type=click.Choice(["float32", "bfloat16"]),
    help="Float contenders, repeatable; the last one is the W8A8 twin's head dtype (default: float32, and bfloat16 where fast).",
)
@json_option
def verify_step(shape, tokens, context, repeats, int8_kernel, int8_lm_head, float_dtypes, as_json):
    """One verify forward (k+1 tokens, warm cache), every float contender vs W8A8, against the fastest float, next to
    the ideal ratio of weight bytes read."""
    from ..bench import micro  # keeps --help torch-free
    from ..cpu.linears import check_int8_kernel, default_float_dtype  # keeps --help torch-free

    if int8_kernel is not None:
        check_int8_kernel(int8_kernel)
    dtypes = tuple(default_float_dtype("cpu", name) for name in float_dtypes) or None
    result = micro.verify_step(
        shape, tokens, context, repeats, int8_kernel=int8_kernel, progress=not as_json, int8_lm_head=int8_lm_head, float_dtypes=dtypes
    )
    dtypes = {"float": ", ".join(result.float_ms), "w8a8": _float_vs_int8(int8_lm_head, head_dtype=result.head_dtype)["w8a8"]}
    _emit(result.to_dict(), lambda: micro.describe_verify_step(result), as_json, dtypes)


@bench.command("kernels")
@shape_option
@click.option("--repeats", default=20, show_default=True, type=click.IntRange(min=1), help="Timed repeats (the best counts).")
@click.option(
    "--int8-kernels",
    default="",
    help="Comma-separated int8 kernels to time side by side, the first reported in full (default: this CPU's default).",
)
@json_option
def kernels(shape, repeats, int8_kernels, as_json):
    """Each linear size of the shape at decode/verify row counts: float vs int8 kernel, each against the memory-bandwidth bound."""
    from ..bench import micro  # keeps --help torch-free
    from ..cpu.linears import check_int8_kernel  # keeps --help torch-free

    chosen = tuple(k.strip() for k in int8_kernels.split(",") if k.strip())
    for kernel in chosen:
        check_int8_kernel(kernel)
    result = micro.linear_kernels(shape, repeats=repeats, progress=not as_json, int8_kernels=chosen)
    _emit(result, lambda: micro.describe_linear_kernels(result), as_json, _float_vs_int8())


@bench.command("gpu")
@click.option("--shapes", default=",".join(DEFAULT_SHAPES), show_default=True, help="Comma-separated synthetic shapes for the verify step.")
@click.option("--tokens", default=6, show_default=True, type=click.IntRange(min=1, max=16), help="Tokens per verify step (k+1).")
@click.option("--context", default=512, show_default=True, type=click.IntRange(min=1), help="Tokens in the cache.")
@click.option("--repeats", default=30, show_default=True, type=click.IntRange(min=1), help="Timed verify pairs.")
@click.option("--rows", default=",".join(map(str, DEFAULT_ROWS)), show_default=True, type=INT_LIST, help="GEMM rows M.")
@click.option("--e2e-shape", default="qwen3-1.7b", show_default=True, help="Synthetic shape of the second end-to-end run.")
@click.option("--prompts", default=5, show_default=True, type=click.IntRange(min=1), help="Built-in prompts end to end.")
@click.option("--max-new-tokens", default=128, show_default=True, type=click.IntRange(min=1))
@click.option("--num-draft", default=5, show_default=True, type=click.IntRange(min=1))
@click.option("--quantizer", default="triton", show_default=True, type=click.Choice(["triton", "torch"]), help="Activation quantization.")
@json_option
def gpu(shapes, rows, as_json, **options):
    """On a CUDA GPU: verify step bf16 vs W8A8, int8 GEMM bandwidth, n-gram end to end; one table (tools/gpu_check.sh)."""
    from ..bench import gpu as gpu_bench  # keeps --help torch-free

    # the other options are the settings' fields by name (tokens, context, ..., quantizer)
    settings = GpuSettings(shapes=tuple(s.strip() for s in shapes.split(",") if s.strip()), rows=tuple(rows), **options)
    result = gpu_bench.run(settings, log=lambda line: None if as_json else click.echo(line, err=True))
    _emit(result, lambda: gpu_bench.table(result), as_json, gpu_bench.GPU_DTYPES)


@bench.command("write-checkpoint")
@click.argument("shape")
@click.option("-o", "--output", required=True, type=click.Path(file_okay=False, path_type=Path), help="New checkpoint directory.")
@click.option("--dtype", default="bfloat16", show_default=True, type=click.Choice(["bfloat16", "float16", "float32"]))
@click.option("--layers", type=click.IntRange(min=1), help="Fewer layers than the shape has (tests, quick runs).")
@click.option("--max-shard-size", default=5 * 10**9, show_default=True, type=click.IntRange(min=1), help="Bytes per shard.")
@click.option("--seed", default=0, show_default=True, type=int)
def write_checkpoint(shape, output, dtype, layers, max_shard_size, seed):
    """A Hugging Face checkpoint of a published SHAPE with random weights, written shard by shard (qwen3-0.6b ... llama-3-8b)."""
    from ..bench.checkpoint_writer import write_synthetic_checkpoint  # keeps --help torch-free

    path = write_synthetic_checkpoint(shape, output, dtype=dtype, max_shard_size=max_shard_size, seed=seed, layers=layers)
    click.echo(f"wrote {path}")


@bench.group("onnx")
def onnx() -> None:
    """The exported ONNX forms on ONNX Runtime (needs the onnx extra)."""


@onnx.command("layers")
@click.option("--size", default=4096, show_default=True, type=click.IntRange(min=1), help="Square linear size.")
@click.option("--depth", default=4, show_default=True, type=click.IntRange(min=1), help="Distinct layers chained.")
@click.option("--rows", default="1,6,64", show_default=True, type=INT_LIST, help="Comma-separated M (rows of the input).")
@threads_option
@onnx_repeats_option
@json_option
def onnx_layers(size, depth, rows, threads, repeats, as_json):
    """The exported W8A8 linear, integer (as the backend runs it, and re-encoded u8 x u8) and qdq forms, vs a float32
    MatMul of the same shape, and how exact each is."""
    from ..bench.onnx import layers  # keeps --help torch-free

    _lines(layers(size, depth, rows, threads, repeats), as_json, _float_vs_int8())


@onnx.command("step")
@shape_option
@click.option("--tokens", default=6, show_default=True, type=click.IntRange(min=1), help="Tokens per verify step (k+1).")
@click.option("--context", default=128, show_default=True, type=click.IntRange(min=1), help="Tokens in the cache.")
@threads_option
@onnx_repeats_option
@click.option("--torch/--no-torch", "with_torch", default=True, show_default=True, help="Time the cpu backend's decoders too.")
@click.option("--int8-lm-head", is_flag=True, help="The W8A8 contenders with an int8 lm_head (calibrate --int8-lm-head).")
@click.option(
    "--w8a8-acceptance",
    type=click.FloatRange(0, 1, max_open=True),
    help="Exact mode's model: the float model's per-token acceptance of W8A8's tokens (default 0.985; random weights cannot "
    "measure it, bench e2e's exact modes measure it on a real model).",
)
@json_option
def onnx_step(shape, tokens, context, threads, repeats, with_torch, int8_lm_head, w8a8_acceptance, as_json):
    """A k+1-token verify on a warm cache, ONNX Runtime float and W8A8 graphs and the cpu backend's float and W8A8
    decoders, timed round robin; speed-ups against each round's best float; with the cpu backend's, exact mode modelled
    at the paper's acceptance from those step costs."""
    from ..bench.onnx import step  # keeps --help torch-free

    _lines(step(shape, tokens, context, threads, repeats, with_torch, int8_lm_head, w8a8_acceptance), as_json, _float_vs_int8(int8_lm_head))


@onnx.command("fidelity")
@click.argument("exported", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("source", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--steps", default=64, show_default=True, type=click.IntRange(min=1), help="Greedy tokens compared.")
@click.option("--prompts", type=click.Path(dir_okay=False, path_type=Path), help="JSONL or text prompts (default: three built-in ones).")
@click.option("--limit", type=click.IntRange(min=1), help="Only the first N prompts.")
@threads_option
@json_option
def onnx_fidelity(exported, source, steps, prompts, limit, threads, as_json):
    """An EXPORTED directory on ONNX Runtime against the torch decoder of SOURCE (the artifact or checkpoint it was exported from)."""
    from ..bench.onnx import fidelity  # keeps --help torch-free

    _lines(fidelity(exported, source, steps, threads, prompts, limit), as_json, _dtypes_of(str(source)))


def _lines(lines: Iterable[str], as_json: bool, dtypes: dict[str, str]) -> None:
    """A report made of lines: each printed as it comes (a run takes minutes), or all in one record's ``figures["lines"]``."""
    if as_json:
        _emit({"lines": list(lines)}, str, as_json, dtypes)
        return
    for line in lines:
        click.echo(line)


@bench.command("report")
@click.argument("records", nargs=-1, type=click.Path(exists=True, path_type=Path))
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), help="Write the page here (default: print it).")
def report_command(records, output):
    """Render the benchmarks page (docs/benchmarks.md) from RECORDS (`bench ... --json` outputs, or directories of them;
    default bench/results): the newest value of each quantity per machine."""
    page = render(read_records(records or [Path("bench/results")]))
    if output is None:
        click.echo(page, nl=False)
    else:
        output.write_text(page, encoding="utf-8")
        click.echo(f"wrote {output}")
