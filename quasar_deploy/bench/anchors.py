"""Anchors: the CPU engines a user would pick instead (llama.cpp, vLLM's CPU build), timed on the benchmark's prompts.

Each runs ``anchor_runner.py`` under its own venv's python (neither may share our environment); a mode that cannot run
gets a one-line reason in the report instead of figures. Torch-free: ``modes`` reads the mode names for ``--help``."""

from __future__ import annotations

import ctypes.util
import json
import os
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..cache import locked
from ..errors import QuasarError
from ..files import atomic_directory, first_line, sha256_files

PYTHON_VARIABLES = {"llamacpp": "QUASAR_LLAMACPP_PYTHON", "vllm": "QUASAR_VLLM_PYTHON"}
CONVERTER_VARIABLE = "QUASAR_LLAMACPP_CONVERTER"
RUNNER = Path(__file__).with_name("anchor_runner.py")
GGUF_TYPE = "q8_0"
TIMEOUT_S = 3600
VLLM_DTYPE = "bfloat16"  # vLLM's CPU build computes in bf16 or float32; a float16 checkpoint would fall back to slow linears


@dataclass(frozen=True)
class AnchorMode:
    """One anchor configuration: which engine, on which of our two models, with or without n-gram drafting."""

    engine: str  # a key of PYTHON_VARIABLES
    source: str  # "float": our float checkpoint (llama.cpp converts it to GGUF q8_0); "w8a8": our artifact
    speculative: bool
    numerics: str  # what the engine computes, for the report


_Q8_0 = (
    "llama.cpp q8_0: weights int8 in blocks of 32 with one fp16 scale each, lm_head included; its CPU matmul quantizes "
    "activations to the same blocks (integer dot products)"
)
_VLLM_W8A8 = "vLLM CPU, our compressed-tensors artifact: int8 weights per channel, int8 activations per token (its W8A8 kernels)"
ANCHOR_MODES: dict[str, AnchorMode] = {
    "llamacpp-q8_0": AnchorMode("llamacpp", "float", False, _Q8_0),
    "llamacpp-q8_0-lookup": AnchorMode("llamacpp", "float", True, _Q8_0 + "; prompt lookup drafting"),
    "vllm-w8a8": AnchorMode("vllm", "w8a8", False, _VLLM_W8A8),
    "vllm-w8a8-ngram": AnchorMode("vllm", "w8a8", True, _VLLM_W8A8 + "; n-gram speculation"),
    "vllm-float-ngram": AnchorMode("vllm", "float", True, "vLLM CPU, our float checkpoint; n-gram speculation"),
}


class AnchorSkipped(Exception):
    """Why an anchor mode has no figures: one line for the report (not installed, not configured, the engine failed)."""


@dataclass(frozen=True)
class AnchorRun:
    tokens: list[int]
    wall_s: float


@dataclass(frozen=True)
class AnchorResult:
    engine: str
    version: str
    runs: list[AnchorRun]
    details: dict


def pythons(given: Mapping[str, str]) -> dict[str, str]:
    """Each engine's python: ``given`` (``--anchor-python ENGINE=PATH``) over the environment variables."""
    unknown = sorted(set(given) - set(PYTHON_VARIABLES))
    if unknown:
        raise QuasarError(f"--anchor-python: unknown engine {unknown[0]!r}; choose from {', '.join(PYTHON_VARIABLES)}")
    found = {engine: os.environ[variable] for engine, variable in PYTHON_VARIABLES.items() if os.environ.get(variable)}
    return {**found, **given}


def python_for(engine: str, configured: Mapping[str, str]) -> Path:
    """The configured python of ``engine``, or AnchorSkipped saying how to configure one."""
    if engine not in configured:
        raise AnchorSkipped(f"{engine} not configured: set {PYTHON_VARIABLES[engine]} or --anchor-python {engine}=PYTHON (docs/anchors.md)")
    python = Path(configured[engine])
    if not (python.is_file() and os.access(python, os.X_OK)):
        raise AnchorSkipped(f"{engine}: {python} is not an executable python")
    return python


def _clean_environment(python: Path | None = None) -> dict[str, str]:
    """Ours minus other environments' packages; with ``python`` (vLLM's), tcmalloc and its Intel OpenMP preloaded (vLLM asks)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP")}
    if python is not None:
        iomp = python.parent.parent / "lib" / "libiomp5.so"
        preload = [ctypes.util.find_library("tcmalloc_minimal") or ctypes.util.find_library("tcmalloc")]
        preload += [str(iomp) if iomp.is_file() else None, env.get("LD_PRELOAD")]
        env["LD_PRELOAD"] = " ".join(filter(None, preload))
    return env


def request(
    mode: str,
    model: Path,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    stop_ids: Sequence[int],
    threads: int,
    num_draft: int,
    ngram: tuple[int, int],
) -> dict:
    """The runner's request for ``mode`` on ``model`` (a GGUF file or a model directory): greedy, batch 1, our token ids."""
    anchor = ANCHOR_MODES[mode]
    context = max(len(p) for p in prompts) + max_new_tokens + num_draft + 16
    speculative = {"num_draft": num_draft, "ngram_min": ngram[0], "ngram_max": ngram[1]} if anchor.speculative else None
    return {
        "engine": anchor.engine,
        "model": str(model),
        "prompts": [list(map(int, p)) for p in prompts],
        "max_new_tokens": max_new_tokens,
        "stop_ids": sorted(int(t) for t in stop_ids),
        "threads": threads,
        "context": max(256, context),
        "speculative": speculative,
        "warmup_tokens": 4,
        "dtype": VLLM_DTYPE,
    }


def _json_object(text: str) -> dict:
    """The runner's stdout as a JSON object, or AnchorSkipped saying it is none."""
    try:
        reply = json.loads(text)
    except json.JSONDecodeError:
        raise AnchorSkipped(f"the runner's reply is not JSON: {text.strip()[:200]!r}") from None
    if not isinstance(reply, dict):
        raise AnchorSkipped("the runner's reply is not a JSON object")
    return reply


def parse_response(text: str, prompt_count: int) -> AnchorResult:
    """The runner's stdout as an AnchorResult; its ``error``, or a malformed reply, as AnchorSkipped."""
    reply = _json_object(text)
    if "error" in reply:
        raise AnchorSkipped(str(reply["error"]))
    try:
        runs = [AnchorRun([int(t) for t in r["tokens"]], float(r["wall_s"])) for r in reply["runs"]]
        result = AnchorResult(str(reply["engine"]), str(reply["version"]), runs, dict(reply.get("details") or {}))
    except (KeyError, TypeError, ValueError) as exc:
        raise AnchorSkipped(f"the runner's reply lacks a field: {first_line(exc)}") from None
    if len(runs) != prompt_count or any(r.wall_s <= 0 for r in runs):
        raise AnchorSkipped(f"the runner returned {len(runs)} runs for {prompt_count} prompts, or a non-positive time")
    return result


def run(python: Path, anchor_request: dict, timeout_s: float = TIMEOUT_S) -> AnchorResult:
    """``anchor_request`` through the runner under ``python``; the engine's log goes to our stderr."""
    return parse_response(_reply_text(python, anchor_request, timeout_s), len(anchor_request["prompts"]))


def _reply_text(python: Path, anchor_request: dict, timeout_s: float) -> str:
    try:
        done = subprocess.run(
            [str(python), str(RUNNER)],
            input=json.dumps(anchor_request),
            stdout=subprocess.PIPE,
            stderr=None,  # the engine's log: our stderr (descriptor 2, whoever wraps sys.stderr)
            text=True,
            timeout=timeout_s,
            env=_clean_environment(python if anchor_request["engine"] == "vllm" else None),
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise AnchorSkipped(f"{anchor_request['engine']}: no reply within {timeout_s:.0f} s") from None
    except OSError as exc:
        raise AnchorSkipped(f"{python}: {first_line(exc)}") from None
    if not done.stdout.strip():
        raise AnchorSkipped(f"{anchor_request['engine']} runner exited with status {done.returncode} and no reply (its log is above)")
    return done.stdout


def converter_for(python: Path) -> Path:
    """llama.cpp's ``convert_hf_to_gguf.py``: $QUASAR_LLAMACPP_CONVERTER, else ``convert/`` in the anchor's venv."""
    configured = os.environ.get(CONVERTER_VARIABLE)
    converter = Path(configured) if configured else python.parent.parent / "convert" / "convert_hf_to_gguf.py"
    if not converter.is_file():
        raise AnchorSkipped(f"llamacpp: no GGUF converter at {converter}: set {CONVERTER_VARIABLE} (docs/anchors.md)")
    return converter


def gguf_for(python: Path, checkpoint: Path, cache: Path) -> Path:
    """The float checkpoint converted to GGUF q8_0 by the runner once, cached under ``cache`` by its and the converter's bytes."""
    converter = converter_for(python)
    weights = sorted(checkpoint.glob("*.safetensors"))
    if not weights:
        raise AnchorSkipped(f"llamacpp: {checkpoint} holds no safetensors weights to convert")
    key = sha256_files(checkpoint / "config.json", *weights, converter)[:12]
    target = cache / f"gguf-{key}"
    name = f"model-{GGUF_TYPE}.gguf"
    with locked(target):  # two benchmarks started together convert once
        if (target / name).is_file():
            return target / name
        with atomic_directory(target) as tmp:
            job = {"converter": str(converter), "checkpoint": str(checkpoint), "outfile": str(tmp / name), "outtype": GGUF_TYPE}
            reply = _json_object(_reply_text(python, {"engine": "llamacpp", "convert": job}, TIMEOUT_S))
            if "error" in reply or not (tmp / name).is_file():
                raise AnchorSkipped(f"llamacpp: GGUF conversion failed: {reply.get('error', 'no file written')}")
            (tmp / "conversion.json").write_text(json.dumps({"source": str(checkpoint), **reply}))
    return target / name


def anchor_phase(
    modes: Sequence[str],
    models: tuple[Path, Path] | None,
    encoded: Sequence[Sequence[int]],
    stop_ids: Sequence[int],
    configured: Mapping[str, str],
    options: dict,
    cache: Path,
) -> tuple[dict[str, AnchorResult], dict[str, str]]:
    """Every anchor mode in ``modes`` on our (float, W8A8) ``models``, one runner each: what ran, and why the others did not."""
    results: dict[str, AnchorResult] = {}
    skipped: dict[str, str] = {}
    for mode in modes:
        anchor = ANCHOR_MODES[mode]
        try:
            if models is None:
                raise AnchorSkipped("synthetic weights live in memory only: anchors need a checkpoint and artifact on disk")
            python = python_for(anchor.engine, configured)
            model = models[0] if anchor.source == "float" else models[1]
            if anchor.engine == "llamacpp":
                model = gguf_for(python, model, cache)
            results[mode] = run(python, request(mode, model, encoded, stop_ids=stop_ids, **options))
        except AnchorSkipped as reason:
            skipped[mode] = f"{mode}: {reason}"
    return results, skipped


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share: the first position where they differ, else the shorter length."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def token_match(tokens: Sequence[Sequence[int]], reference: Sequence[Sequence[int]]) -> dict:
    """How far an anchor's greedy tokens follow ours: the share equal at the same position, and the mean common prefix."""
    total = sum(len(r) for r in reference)
    same = sum(sum(x == y for x, y in zip(t, r)) for t, r in zip(tokens, reference))
    prefixes = [_common_prefix(t, r) for t, r in zip(tokens, reference)]
    return {"share": same / total if total else 1.0, "mean_common_prefix": sum(prefixes) / len(prefixes) if prefixes else 0.0}
