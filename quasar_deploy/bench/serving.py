"""``bench serve``: our server on 127.0.0.1 under closed-loop streaming clients, at each concurrency in turn.

At every level, ``concurrency`` clients share the prompts, each sending its next one when its last has finished; the server
runs in a process of its own (``quasar_server``), except on a synthetic model, which exists only here."""

from __future__ import annotations

import contextlib
import gc
import itertools
import json
import math
import os
import queue
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from operator import itemgetter
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from ..api import load
from ..artifact import open_model_files
from ..backends.torch_backend import cpu_causal_lm
from ..demo import demo_artifact, demo_model_path
from ..engine import Engine, warm_up
from ..errors import QuasarError
from ..files import atomic_directory, first_line
from ..memory import return_freed_memory
from ..serve.app import ServeConfig, create_app
from ..serve.local import free_port, serving_in_thread, wait_healthy
from ..serve.needs import REQUEST_DRAFTERS
from ..serve.scheduler import PREFILL_TOKENS
from ..speculative.registry import default_num_draft
from ..tokenizer import load_tokenizer
from .anchors import _clean_environment
from .e2e import environment, median_run, read_prompts
from .modes import k_text
from .synthetic import synthetic_w8a8_decoder

WARM_UP_TOKENS = 8
MODEL_NAME = "bench"


@dataclass(frozen=True)
class ServeBenchSettings:
    prompts: str
    limit: int = 16
    concurrency: Sequence[int] = (1, 4, 8)
    max_tokens: int = 128
    draft: str = "ngram"
    num_draft: int | None = None  # None: each request's drafter's own (speculative.registry)
    artifact: str | None = None
    synthetic: str | None = None
    backend: str = "auto"
    prefill_tokens: int = PREFILL_TOKENS
    compare: Sequence[str] = ()  # more drafting variants (``variant_options``), each through the same server after ``draft``
    rounds: int = 1  # runs of ``draft`` and each variant, interleaved (``interleaved``); each level's figure its median run
    row_budget: bool = True  # our server's --row-budget (False: --all-rows)


def variant_options(variant: str) -> dict[str, Any]:
    """The request fields of a drafting variant (``"suffix"``, ``"ngram-adaptive"``: a k per sequence)."""
    draft, _, kind = variant.partition("-")
    if draft not in REQUEST_DRAFTERS or kind not in ("", "adaptive") or (draft == "none" and kind):
        drafters = ", ".join(d for d in REQUEST_DRAFTERS if d != "none")
        raise QuasarError(f"--compare takes drafters ({drafters}, none), each optionally with -adaptive; got {variant!r}")
    return {"draft": draft, "adaptive_k": kind == "adaptive"} if draft != "none" else {"draft": "none"}


@dataclass(frozen=True)
class RequestTiming:
    """One streamed request as its client saw it."""

    ttft_s: float
    gaps_s: list[float]
    output_tokens: int


class WideVocabulary:
    """The demo tokenizer for a synthetic model with a larger vocabulary: an id past the tokenizer's reads as `` <id>``, so
    that random weights, which mostly pick such ids, still stream text a client can time (the text means nothing)."""

    def __init__(self, tokenizer: Any):
        self._tokenizer = tokenizer
        self._known = len(tokenizer)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        pieces = []
        for known, run in itertools.groupby(ids, lambda token: token < self._known):
            if known:
                pieces.append(self._tokenizer.decode(list(run), skip_special_tokens=skip_special_tokens))
            else:
                pieces.extend(f" <{token}>" for token in run)
        return "".join(pieces)


def synthetic_engine(shape: str) -> tuple[Engine, str]:
    """An engine over W8A8 random weights of a published shape, and how the report names it (timing only)."""
    lm = cpu_causal_lm(synthetic_w8a8_decoder(shape), kind="W8A8 synthetic")
    warm_up(lm)
    tokenizer = WideVocabulary(load_tokenizer(open_model_files(demo_model_path())))
    return Engine(lm, tokenizer, frozenset(), "cpu"), f"synthetic {shape} W8A8 (random weights)"


def stream_completion(client: httpx.Client, base: str, prompt: str, max_tokens: int, options: dict[str, Any]) -> RequestTiming:
    """One streamed greedy completion; ``options``: further request fields (a drafting variant's)."""
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, **options}
    body["stream_options"] = {"include_usage": True}  # the last chunk: usage alone, with empty choices
    sent = time.perf_counter()
    arrivals: list[float] = []
    usage = None
    with client.stream("POST", f"{base}/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise QuasarError(f"the server answered {response.status_code}: {response.read().decode()[:200]}")
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[len("data: ") :])
            if chunk["choices"] and chunk["choices"][0].get("text"):
                arrivals.append(time.perf_counter())
            usage = chunk.get("usage") or usage
    if usage is None or not arrivals:
        raise QuasarError("a streamed completion ended without text or usage")
    return RequestTiming(arrivals[0] - sent, [b - a for a, b in zip(arrivals, arrivals[1:])], usage["completion_tokens"])


def acceptance_totals(client: httpx.Client, base: str) -> tuple[float, float]:
    """The server's acceptance-length histogram so far: (sum, count)."""
    samples = {
        sample.name: sample.value
        for family in text_string_to_metric_families(client.get(f"{base}/metrics").text)
        for sample in family.samples
        if sample.name.startswith("quasar_acceptance_length_")
    }
    return samples.get("quasar_acceptance_length_sum", 0.0), samples.get("quasar_acceptance_length_count", 0.0)


def percentile(values: Sequence[float], p: float) -> float | None:
    """Nearest-rank percentile (None for no values)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


def run_level(
    client: httpx.Client, base: str, prompts: Sequence[str], concurrency: int, max_tokens: int, options: dict[str, Any]
) -> dict[str, Any]:
    """Every prompt once, from ``concurrency`` closed-loop clients, each request with the fields ``options``."""
    pending: queue.SimpleQueue[str] = queue.SimpleQueue()
    for prompt in prompts:
        pending.put(prompt)

    def client_loop() -> list[RequestTiming]:
        timings = []
        while True:
            try:
                prompt = pending.get_nowait()
            except queue.Empty:
                return timings
            timings.append(stream_completion(client, base, prompt, max_tokens, options))

    accepted_before, steps_before = acceptance_totals(client, base)
    began = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        futures = [pool.submit(client_loop) for _ in range(concurrency)]
        timings = [t for f in futures for t in f.result()]
    wall_s = time.perf_counter() - began
    accepted_after, steps_after = acceptance_totals(client, base)
    tokens = sum(t.output_tokens for t in timings)
    ttft = [t.ttft_s * 1000 for t in timings]
    gaps = [g * 1000 for t in timings for g in t.gaps_s]
    steps = steps_after - steps_before
    return {
        "concurrency": concurrency,
        "requests": len(timings),
        "output_tokens": tokens,
        "wall_s": wall_s,
        "tokens_per_s": tokens / wall_s,
        **{f"{name}_ms_p{p}": percentile(values, p) for name, values in (("ttft", ttft), ("itl", gaps)) for p in (50, 99)},
        "acceptance_length": (accepted_after - accepted_before) / steps if steps else None,
    }


def run_levels(
    base: str, prompts: Sequence[str], settings: ServeBenchSettings, name: str, progress: bool, options: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """A warm-up round at the widest concurrency (every batch size's kernels built), then each level, requests ``options``."""
    widest = max(settings.concurrency)
    levels = []
    options = options or {}
    with httpx.Client(timeout=None) as client:
        run_level(client, base, prompts[:widest], widest, WARM_UP_TOKENS, options)
        for concurrency in settings.concurrency:
            levels.append(run_level(client, base, prompts, concurrency, settings.max_tokens, options))
            if progress:
                print(f"{name}, concurrency {concurrency}: {levels[-1]['tokens_per_s']:.1f} output tokens/s", flush=True)
    return against_one_client(levels)


def against_one_client(levels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``levels``, each with its throughput over the 1-client level's (None where there is none)."""
    single = next((level["tokens_per_s"] for level in levels if level["concurrency"] == 1), None)
    for level in levels:
        level["throughput_vs_concurrency_1"] = level["tokens_per_s"] / single if single else None
    return levels


def interleaved(names: Sequence[str], rounds: int, run: Callable[[str], list[dict[str, Any]]]) -> dict[str, list[dict[str, Any]]]:
    """``run(name)`` for each of ``names``, ``rounds`` times in a rotated order; per name and level, the median run."""
    runs: dict[str, list[list[dict[str, Any]]]] = {name: [] for name in names}
    for turn in range(rounds):
        shift = turn % len(names)
        for name in [*names[shift:], *names[:shift]]:
            runs[name].append(run(name))

    def pick(at_level: tuple[dict[str, Any], ...]) -> dict[str, Any]:
        every = {"tokens_per_s_rounds": [attempt["tokens_per_s"] for attempt in at_level]} if rounds > 1 else {}
        return dict(median_run(at_level, itemgetter("tokens_per_s"))) | every

    return {name: against_one_client([pick(at_level) for at_level in zip(*attempts)]) for name, attempts in runs.items()}


def benchmark_serving(settings: ServeBenchSettings, progress: bool = True, vllm_python: Path | None = None) -> dict[str, Any]:
    """Serve the model, warm the batched path up, then run each concurrency level in turn (then vLLM's, with ``vllm_python``)."""
    if not settings.concurrency or min(settings.concurrency) < 1:
        raise QuasarError("--concurrency takes integers >= 1, e.g. 1,4,8")
    if settings.rounds < 1:
        raise QuasarError(f"--rounds takes an integer >= 1, got {settings.rounds}")
    if vllm_python is not None and not settings.artifact:
        raise QuasarError("vLLM serves an artifact directory: give ARTIFACT, not --synthetic or the default")
    prompts = read_prompts(settings.prompts, settings.limit)
    variants = {variant: variant_options(variant) for variant in settings.compare}  # refused before any work
    widest = max(settings.concurrency)
    load_average = os.getloadavg()
    alone = None if settings.synthetic else generate_alone(settings, prompts, progress)
    with (synthetic_server if settings.synthetic else quasar_server)(settings, widest) as (base, label, backend):
        runs = interleaved(
            ["", *variants],
            settings.rounds,
            lambda v: run_levels(base, prompts, settings, f"quasar-deploy {v}".strip(), progress, variants.get(v)),
        )
        levels, compared = runs.pop(""), runs
    report = {
        "settings": {**asdict(settings), "concurrency": list(settings.concurrency), "model": label, "prompt_count": len(prompts)},
        "environment": {**environment(), "load_average_at_start": list(load_average)},
        "backend": backend,
        "levels": levels,
    }
    if compared:  # the same server, prompts and levels, after ``levels``: per variant, its levels and each level vs ours
        for variant_levels in compared.values():
            for ours, level in zip(levels, variant_levels):
                level["vs_draft"] = level["tokens_per_s"] / ours["tokens_per_s"] if ours["tokens_per_s"] else None
        report["compared"] = compared
    if alone is not None:
        report["generate"] = alone
        for level in levels:
            level["vs_generate"] = level["tokens_per_s"] / alone["tokens_per_s"] if level["concurrency"] == 1 else None
    if vllm_python is not None:
        with vllm_server(vllm_python, settings, widest) as (base, version):
            vllm_levels = run_levels(base, prompts, settings, "vLLM", progress)
        report["vllm"] = {"version": version, "levels": vllm_levels}
        for ours, theirs in zip(levels, vllm_levels):
            ours["vs_vllm"] = ours["tokens_per_s"] / theirs["tokens_per_s"] if theirs["tokens_per_s"] else None
    report["environment"]["load_average_at_end"] = list(os.getloadavg())
    return report


def generate_alone(settings: ServeBenchSettings, prompts: Sequence[str], progress: bool) -> dict[str, Any]:
    """``generate`` on the same prompts one at a time, on the default backend: what a lone user gets without the server."""
    engine = load(settings.artifact or _demo_artifact())
    options = dict(max_new_tokens=settings.max_tokens, draft=settings.draft, num_draft=settings.num_draft)  # None: the drafter's
    engine.generate(prompts[0], **{**options, "max_new_tokens": WARM_UP_TOKENS})
    began, tokens = time.perf_counter(), 0
    for prompt in prompts:
        tokens += len(engine.generate(prompt, **options).tokens)
    alone = {"backend": engine.lm.description, "tokens_per_s": tokens / (time.perf_counter() - began), "output_tokens": tokens}
    if progress:
        print(f"generate alone ({alone['backend']}): {alone['tokens_per_s']:.1f} output tokens/s", flush=True)
    del engine
    gc.collect()
    return_freed_memory()
    return alone


def _demo_artifact() -> str:
    return str(demo_artifact(progress=False))


@contextmanager
def synthetic_server(settings: ServeBenchSettings, max_sequences: int) -> Iterator[tuple[str, str, str]]:
    """Our server on a synthetic model, in threads of this process: its base URL, the model's label, the backend."""
    engine, label = synthetic_engine(settings.synthetic)
    same = {name: getattr(settings, name) for name in ("draft", "num_draft", "prefill_tokens", "row_budget")}
    config = ServeConfig(MODEL_NAME, max_sequences=max_sequences, max_queue=max_sequences, **same)
    with serving_in_thread(create_app(engine, config)) as base:
        yield base, label, engine.lm.description


QUASAR_START_S = 900  # loading and warming up an 8B artifact on 2 cores takes minutes
STARTED = f"serving {MODEL_NAME} on "  # the start of the line `quasar-deploy serve` prints once its model is loaded


@contextmanager
def quasar_server(settings: ServeBenchSettings, max_sequences: int) -> Iterator[tuple[str, str, str]]:
    """``quasar-deploy serve`` in its own process: its base URL, the artifact, and the backend its startup line names."""
    artifact = settings.artifact or _demo_artifact()
    port = free_port()
    argv = [sys.executable, "-c", "from quasar_deploy.cli import main; main()", "serve", artifact, "--backend", settings.backend]
    argv += ["--port", str(port), "--model-name", MODEL_NAME, "--max-sequences", str(max_sequences), "--max-queue", str(max_sequences)]
    argv += ["--draft", settings.draft, "--prefill-tokens", str(settings.prefill_tokens)]
    argv += [] if settings.row_budget else ["--all-rows"]
    argv += ["--num-draft", str(settings.num_draft)] if settings.num_draft else []
    with server_process(argv, os.environ.copy(), port, QUASAR_START_S, "quasar-deploy") as (base, log):
        backend = next((line.removeprefix(STARTED) for line in log() if line.startswith(STARTED)), "?")
        yield base, artifact, backend


VLLM_START_S = 900  # vLLM's CPU build compiles and warms up its kernels at start: minutes on 2 cores


@contextmanager
def vllm_server(python: Path, settings: ServeBenchSettings, max_sequences: int) -> Iterator[tuple[str, str]]:
    """vLLM's OpenAI server (its CPU build, docs/anchors.md) on ``settings.artifact`` in bf16: its base URL and version."""
    version = subprocess.run([str(python), "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True)
    if version.returncode != 0:
        raise QuasarError(f"{python}: cannot import vllm ({(version.stderr.strip().splitlines() or ['?'])[-1]})")
    port = free_port()
    argv = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(settings.artifact)]
    argv += ["--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16"]
    context = min(4096, open_model_files(settings.artifact).spec.max_position_embeddings)
    argv += ["--max-num-seqs", str(max_sequences), "--max-model-len", str(context), "--seed", "0"]
    # every level sends the same prompts again: vLLM's prefix cache would prefill each once per run, not once per request
    argv += ["--no-enable-prefix-caching"]
    if settings.draft == "ngram":
        k = settings.num_draft or default_num_draft("ngram")
        spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
        argv += ["--speculative-config", json.dumps(spec)]
    elif settings.draft != "none":
        raise QuasarError(f"vLLM drafts with ngram or none, not {settings.draft!r}")
    env = _clean_environment(Path(python)) | {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    with server_process(argv, env, port, VLLM_START_S, "vLLM") as (base, _):
        yield base, version.stdout.strip()


@contextmanager
def server_process(argv: list[str], env: dict[str, str], port: int, start_s: float, name: str) -> Iterator[tuple[str, Any]]:
    """``argv`` serving on ``port`` in its own process once it answers /health: its base URL and its log lines so far."""
    with tempfile.TemporaryFile("w+") as log:

        def lines() -> list[str]:
            log.seek(0)
            return [line for line in log.read().splitlines() if line.strip()]

        process = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        base = f"http://127.0.0.1:{port}"
        try:
            try:
                wait_healthy(base, start_s, process)
            except (RuntimeError, TimeoutError) as exc:
                said = lines() or ["no output"]
                why = next((line for line in reversed(said) if "Error" in line or "error:" in line), said[-1])
                raise QuasarError(f"{name}'s server did not start ({first_line(exc)}); its log says: {why.strip()[:300]}") from None
            yield base, lines
        finally:
            stop_process_group(process)


STOP_S = 30


def stop_process_group(process: subprocess.Popen, timeout_s: float = STOP_S) -> None:
    """SIGTERM to the whole process group, then SIGKILL after ``timeout_s``: vLLM's engine process outlives its API server."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        process.poll()  # reap the leader, so that only live members keep the group
        try:
            os.killpg(process.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def markdown(report: dict[str, Any]) -> str:
    s, env = report["settings"], report["environment"]
    load = " ".join(f"{x:.2f}" for x in env["load_average_at_start"])
    lines = [
        "# quasar-deploy serving benchmark",
        "",
        f"Model: {s['model']}. Prompts: {s['prompt_count']} from {s['prompts']}, each once per level. Streaming, greedy, "
        f"max_tokens {s['max_tokens']}, draft {s['draft']} {k_text(s['num_draft'], s['draft'])}. "
        f"CPU: {env['cpu']}, {env['threads']} threads; load average at start {load}."
        + (f" Each level: the median of {s['rounds']} runs, interleaved with the variants below." if s.get("rounds", 1) > 1 else ""),
        "",
        "| concurrency | requests | output tokens/s | vs concurrency 1 | TTFT p50 / p99 ms | inter-token p50 / p99 ms "
        "| acceptance length |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for level in report["levels"]:
        ratio = level["throughput_vs_concurrency_1"]
        accept = level["acceptance_length"]
        lines.append(
            f"| {level['concurrency']} | {level['requests']} | {level['tokens_per_s']:.1f} | "
            f"{'-' if ratio is None else f'{ratio:.2f}x'} | {_ms(level['ttft_ms_p50'])} / {_ms(level['ttft_ms_p99'])} | "
            f"{_ms(level['itl_ms_p50'])} / {_ms(level['itl_ms_p99'])} | {'-' if accept is None else f'{accept:.2f}'} |"
        )
    if "generate" in report:
        alone, first = report["generate"], report["levels"][0]
        versus = f"; the server at 1 client: {first['vs_generate']:.2f}x that" if first.get("vs_generate") else ""
        lines += ["", f"`generate` alone, the same prompts one at a time ({alone['backend']}): {alone['tokens_per_s']:.1f} tokens/s"]
        lines[-1] += f"{versus}."
    for variant, variant_levels in report.get("compared", {}).items():
        k = k_text(s["num_draft"], variant.partition("-")[0])
        when = "in turn with the levels above" if s.get("rounds", 1) > 1 else "after the levels above"
        lines += ["", f"Drafting {variant} ({k} at most), the same server and prompts, {when}:", ""]
        lines += ["| concurrency | output tokens/s | TTFT p50 ms | acceptance length | vs draft " + s["draft"] + " |"]
        lines += ["| --- | --- | --- | --- | --- |"]
        for level in variant_levels:
            accept, ratio = level["acceptance_length"], level["vs_draft"]
            lines.append(
                f"| {level['concurrency']} | {level['tokens_per_s']:.1f} | {_ms(level['ttft_ms_p50'])} | "
                f"{'-' if accept is None else f'{accept:.2f}'} | {'-' if ratio is None else f'{ratio:.2f}x'} |"
            )
    if "vllm" in report:
        lines += ["", f"vLLM {report['vllm']['version']} (CPU build), the same artifact, prompts and settings, bf16:", ""]
        lines += ["| concurrency | output tokens/s | TTFT p50 ms | inter-token p50 ms | ours vs vLLM |", "| --- | --- | --- | --- | --- |"]
        for ours, level in zip(report["levels"], report["vllm"]["levels"]):
            lines.append(
                f"| {level['concurrency']} | {level['tokens_per_s']:.1f} | {_ms(level['ttft_ms_p50'])} | {_ms(level['itl_ms_p50'])} | "
                f"{ours['vs_vllm']:.2f}x |"
            )
    lines += ["", "Inter-token latency: gaps between streamed chunks; a chunk is one verify step's text (1 to k+1 tokens)."]
    return "\n".join(lines) + "\n"


def write(report: dict[str, Any], output: str | Path) -> list[Path]:
    """report.json and report.md in a new directory ``output``, written whole or not at all."""
    with atomic_directory(Path(output)) as tmp:
        (tmp / "report.json").write_text(json.dumps(report, indent=2))
        (tmp / "report.md").write_text(markdown(report))
    return [Path(output) / "report.json", Path(output) / "report.md"]
