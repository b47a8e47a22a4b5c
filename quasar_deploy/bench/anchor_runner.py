"""Runs one anchor engine (llama.cpp or vLLM's CPU build) on token-id prompts, inside that engine's own virtual environment.

``bench e2e`` starts this file with the anchor venv's python (``python -I anchor_runner.py``),
never importing the engine into its own process: vLLM's CPU build pins its own torch, and
neither engine may be installed beside quasar-deploy. So this file imports nothing from
quasar-deploy and only the standard library at module level.

Protocol: one JSON request on stdin::

    {"engine": "llamacpp" | "vllm", "model": PATH, "prompts": [[ids...], ...],
     "max_new_tokens": N, "stop_ids": [ids], "threads": T, "context": C,
     "speculative": null | {"num_draft": K, "ngram_min": MIN, "ngram_max": MAX},
     "warmup_tokens": W, "dtype": "bfloat16" | "float32" (vLLM's activations and float weights)}

(``model``: a GGUF file for llama.cpp, a Hugging Face or compressed-tensors directory for vLLM),
and one JSON response on stdout: ``{"engine", "version", "runs": [{"tokens", "wall_s"}],
"details"}`` or ``{"error": ONE_LINE}``. The engines' own logs, C-level prints included, go to
stderr: file descriptor 1 is pointed at stderr before any engine loads.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


class RunnerError(Exception):
    """A reason the engine cannot run this request, reported as the response's one-line ``error``."""


def _llamacpp(request: dict) -> dict:
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    spec = request["speculative"]
    draft = LlamaPromptLookupDecoding(max_ngram_size=spec["ngram_max"], num_pred_tokens=spec["num_draft"]) if spec else None
    llm = llama_cpp.Llama(
        model_path=request["model"],
        n_ctx=request["context"],
        n_threads=request["threads"],
        n_threads_batch=request["threads"],
        draft_model=draft,
        verbose=False,
    )
    stop = set(request["stop_ids"])

    def generate(ids: list[int], max_new_tokens: int) -> list[int]:
        llm.reset()  # no prefix reuse from the previous prompt's cache
        tokens: list[int] = []
        for token in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
            tokens.append(token)  # a stop token is kept, as quasar-deploy's engine keeps it
            if token in stop or len(tokens) == max_new_tokens:
                break
        return tokens

    details = {
        "weights": "GGUF " + os.path.basename(request["model"]),
        "draft": f"LlamaPromptLookupDecoding(max_ngram_size={spec['ngram_max']}, num_pred_tokens={spec['num_draft']})" if spec else "none",
        "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip(),
    }
    return _timed(request, generate, "llama.cpp (llama-cpp-python)", llama_cpp.__version__, details)


def _vllm(request: dict) -> dict:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the default would take a large share of a small machine
    # vLLM keeps one core for its scheduler process by default: on a 2-core machine the model would get one thread
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    import vllm
    from vllm import LLM, SamplingParams

    spec = request["speculative"]
    options: dict[str, Any] = dict(
        model=request["model"],
        dtype=request["dtype"],
        max_model_len=request["context"],
        enforce_eager=True,
        seed=0,
        max_num_seqs=1,
    )
    if spec:
        options["speculative_config"] = {
            "method": "ngram",
            "num_speculative_tokens": spec["num_draft"],
            "prompt_lookup_min": spec["ngram_min"],
            "prompt_lookup_max": spec["ngram_max"],
        }
    llm = LLM(**options)

    def generate(ids: list[int], max_new_tokens: int) -> list[int]:
        params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, stop_token_ids=request["stop_ids"])
        (output,) = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        return list(output.outputs[0].token_ids)

    config = llm.llm_engine.model_config
    details = {
        "weights": request["model"],
        "dtype": str(config.dtype),
        "quantization": config.quantization,
        "speculative_config": options.get("speculative_config"),
    }
    return _timed(request, generate, "vLLM (CPU build)", vllm.__version__, details)


def _timed(request: dict, generate, engine: str, version: str, details: dict) -> dict:
    """Warm the engine on the first prompt, then one timed greedy generation per prompt (batch 1), in order."""
    generate(request["prompts"][0], request["warmup_tokens"])
    runs = []
    for ids in request["prompts"]:
        start = time.perf_counter()
        tokens = generate(ids, request["max_new_tokens"])
        runs.append({"tokens": tokens, "wall_s": time.perf_counter() - start})
    return {"engine": engine, "version": version, "runs": runs, "details": details}


ENGINES = {"llamacpp": (_llamacpp, "llama_cpp"), "vllm": (_vllm, "vllm")}


def respond(request: dict) -> dict:
    """The response to one request; any failure becomes ``{"error": ONE_LINE}`` naming the engine."""
    name = request.get("engine")
    if name not in ENGINES:
        return {"error": f"unknown anchor engine {name!r}; choose from {', '.join(ENGINES)}"}
    run, module = ENGINES[name]
    try:
        __import__(module)
    except ImportError as exc:
        return {"error": f"{module} is not importable by {sys.executable}: {_first_line(exc)}"}
    try:
        return run(request)
    except Exception as exc:  # the engine's own failure is the finding: report it, one line
        return {"error": f"{name} failed: {type(exc).__name__}: {_first_line(exc)}"}


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def main() -> None:
    reply = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # engines print to stdout, C libraries included; only the response goes to the saved descriptor
    try:
        request = json.load(sys.stdin)
    except json.JSONDecodeError as exc:
        response = {"error": f"the request is not JSON: {exc}"}
    else:
        response = respond(request)
    reply.write(json.dumps(response))
    reply.flush()


if __name__ == "__main__":
    main()
