"""Runs one anchor engine (llama.cpp or vLLM's CPU build) on token-id prompts, inside that engine's own virtual environment.

Started by ``bench e2e`` with the anchor venv's python (vLLM's CPU build pins its own torch), it imports only the standard
library at top. Protocol: one JSON request on stdin (``anchors.request``, or ``{"engine": "llamacpp", "convert": {...}}``
for ``_convert``); one JSON response on stdout: ``{"engine", "version", "runs": [{"tokens", "wall_s"}], "details"}``,
``{"converted", "pre_tokenizer"}`` or ``{"error": ONE_LINE}``. Engine logs, C-level prints included, go to stderr."""

from __future__ import annotations

import json
import os
import runpy
import sys
import time
from typing import Any


def _llamacpp(request: dict) -> dict:
    import llama_cpp  # in llama.cpp's venv only
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding  # in llama.cpp's venv only

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
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")  # by default vLLM keeps a core for its scheduler process
    import vllm  # in vLLM's venv only, after the settings above
    from vllm import LLM, SamplingParams  # in vLLM's venv only, after the settings above

    spec = request["speculative"]
    options: dict[str, Any] = dict(
        model=request["model"], dtype=request["dtype"], max_model_len=request["context"], enforce_eager=True, seed=0, max_num_seqs=1
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


def _byte_level_gpt2(checkpoint: str) -> bool:
    """Whether the checkpoint's tokenizer pre-tokenizes as GPT-2 does: one ByteLevel step with its regex, nothing else."""
    try:
        with open(os.path.join(checkpoint, "tokenizer.json"), encoding="utf-8") as handle:
            pre = json.load(handle).get("pre_tokenizer") or {}
    except (OSError, ValueError):
        return False
    return pre.get("type") == "ByteLevel" and pre.get("use_regex", True) is True


def _convert(job: dict) -> dict:
    """llama.cpp's converter on ``job["checkpoint"]``, in this process; a pre-tokenizer it does not know by hash but that is
    GPT-2's (``_byte_level_gpt2``, the demo model's) is declared ``gpt-2`` (the benchmark hands llama.cpp ids, never text)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(job["converter"])))
    from conversion import base  # llama.cpp's converter, found on the path above

    recognized = base.TextModel.get_vocab_base_pre
    declared: list[str] = []

    def get_vocab_base_pre(model, tokenizer) -> str:
        try:
            return recognized(model, tokenizer)
        except NotImplementedError:
            if not _byte_level_gpt2(job["checkpoint"]):
                raise
            declared.append("gpt-2")
            return "gpt-2"

    base.TextModel.get_vocab_base_pre = get_vocab_base_pre
    sys.argv = [job["converter"], job["checkpoint"], "--outtype", job["outtype"], "--outfile", job["outfile"]]
    runpy.run_path(job["converter"], run_name="__main__")
    return {"converted": job["outfile"], "pre_tokenizer": declared[0] if declared else "recognized by the converter"}


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
        return _convert(request["convert"]) if "convert" in request else run(request)
    except SystemExit as exc:  # the converter's argument errors
        return {"error": f"{name} conversion exited: {exc.code}"}
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
