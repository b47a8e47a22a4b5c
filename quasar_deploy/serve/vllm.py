"""``serve --engine vllm``: the same deployment served by vLLM (CUDA) or vLLM-Ascend (NPU) instead of our runtime.

The API key travels in ``VLLM_API_KEY``, not the argv (``ps`` shows argv); the model keeps our engine's name for it."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from ..errors import QuasarError
from ..speculative.registry import default_num_draft

NPU_EXPORT_FILE = "quant_model_description.json"  # what `export --target npu` writes (msModelSlim layout)
VLLM_DRAFTERS = ("ngram", "none")


def ngram_config(num_draft: int) -> dict[str, int | str]:
    """vLLM's prompt-lookup drafter with our defaults (n-grams of 1 to 3 tokens, as `--draft ngram` here)."""
    return {"method": "ngram", "num_speculative_tokens": num_draft, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def check_head(path: Path) -> None:
    """Refuse an int8 lm_head (``calibrate --int8-lm-head``): vLLM may serve garbage from one (docs/cuda.md)."""
    try:
        quantization = json.loads((path / "config.json").read_text()).get("quantization_config") or {}
    except (OSError, ValueError, AttributeError):
        return  # not a checkpoint we can read: vLLM says what is wrong with it
    if quantization.get("quant_method") == "compressed-tensors" and "lm_head" not in quantization.get("ignore", ["lm_head"]):
        raise QuasarError(
            f"{path}: its lm_head is int8 (calibrate --int8-lm-head), which vLLM is not known to load (docs/cuda.md); "
            "serve it with --engine quasar, or calibrate without --int8-lm-head"
        )


def served_name(path: str | Path, model_name: str | None = None) -> str:
    """The model name clients send, whichever engine serves: ``model_name``, else PATH's directory name."""
    return model_name or Path(path).resolve().name


def vllm_command(
    path: str | Path,
    host: str,
    port: int,
    api_key: str | None = None,
    model_name: str | None = None,
    draft: str = "ngram",
    num_draft: int | None = None,
    tensor_parallel_size: int | None = None,
    max_sequences: int | None = None,
    chat_template: str | Path | None = None,
    extra: tuple[str, ...] = (),
) -> tuple[list[str], dict[str, str]]:
    """The argv of ``vllm serve`` and the environment it adds; ``extra`` is appended after ours, as given."""
    if draft not in VLLM_DRAFTERS:
        raise QuasarError(f"--engine vllm drafts with {' or '.join(VLLM_DRAFTERS)}, not {draft!r}")
    check_head(Path(path))
    argv = ["vllm", "serve", str(path), "--host", host, "--port", str(port), "--served-model-name", served_name(path, model_name)]
    if (Path(path) / NPU_EXPORT_FILE).is_file():
        argv += ["--quantization", "ascend"]
    if draft == "ngram":
        argv += ["--speculative-config", json.dumps(ngram_config(num_draft or default_num_draft("ngram")))]
    if tensor_parallel_size:
        argv += ["--tensor-parallel-size", str(tensor_parallel_size)]
    if max_sequences:
        argv += ["--max-num-seqs", str(max_sequences)]
    if chat_template is not None:
        argv += ["--chat-template", str(chat_template)]
    return [*argv, *extra], ({"VLLM_API_KEY": api_key} if api_key else {})


def exec_vllm(argv: list[str], env: dict[str, str]) -> None:
    """Replace this process with vLLM; a missing vllm is one line."""
    if (executable := shutil.which(argv[0])) is None:
        raise QuasarError("vllm is not installed here (pip install vllm; on Ascend, vllm-ascend); or serve with --engine quasar")
    os.execve(executable, argv, {**os.environ, **env})
