"""``quasar-deploy demo``: the shipped model and its function-preserving inflation to the Qwen3-0.6B body, each decoded with
n-gram drafting on float and W8A8 verifiers, end to end (why the inflation: ``inflate.py``)."""

from __future__ import annotations

import gc
import math
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from ..api import load
from ..artifact import MANIFEST, open_model_files
from ..backends.onnx_export_cache import onnx_export_path
from ..backends.registry import auto_backend, unavailable
from ..calibration.data import BUILTIN, read_texts
from ..decoder_spec import expected_shapes
from ..engine import Engine
from ..fidelity import Fidelity, evaluate
from ..memory import return_freed_memory
from ..shapes import SHAPES
from . import (
    DEFAULT_LIMIT,
    DEFAULT_MAX_NEW_TOKENS,
    INFLATED_SHAPE,
    demo_artifact,
    demo_artifact_path,
    demo_model_path,
    inflated_demo,
    inflated_demo_paths,
)
from .measure import NGRAM, NUM_DRAFT, figures, timed_runs
from .needs import check_needs, demo_needs

STREAMED_PROMPT = "import os\n\n\ndef list_python_files(root):\n"
# backend -> its (float, W8A8) modes, measured in this order
BACKEND_MODES = {"cpu": ("ngram-float", "ngram-w8a8"), "onnxruntime": ("ngram-float-ort", "ngram-w8a8-ort")}


def parameters_read_per_step(model: str | Path) -> int:
    """Weights one forward step reads: every linear and the lm_head (the embedding lookup reads a few rows)."""
    shapes = expected_shapes(open_model_files(model).spec)
    head = "lm_head.weight" if "lm_head.weight" in shapes else "model.embed_tokens.weight"
    names = [n for n in shapes if n.endswith("_proj.weight")] + [head]
    return sum(math.prod(shapes[n]) for n in names)


def _measure(
    model: Path,
    artifact: Path,
    with_ort: bool,
    prompts: list[str],
    max_new_tokens: int,
    before: Callable[[dict[str, Engine]], None] | None = None,
) -> dict:
    """Every mode on the prompts, one backend's engines at a time; ``before(engines)`` runs on the first backend's."""
    runs: dict[str, list] = {}
    backends: dict[str, str] = {}
    encoded: list[list[int]] = []
    for backend, (float_mode, w8a8_mode) in BACKEND_MODES.items():
        if backend == "onnxruntime" and not with_ort:
            continue
        engines = {float_mode: load(model, backend=backend), w8a8_mode: load(artifact, backend=backend)}
        if not encoded:
            encoded = [engines[float_mode].encode(p) for p in prompts]
            if before is not None:
                before(engines)
        runs |= timed_runs(engines, encoded, max_new_tokens)
        backends |= {mode: engine.lm.description for mode, engine in engines.items()}
        del engines
        gc.collect()  # the next backend's engines load into the memory these held
        return_freed_memory()
    modes = figures(runs, [mode for mode in runs if "float" in mode])
    result = {"model": str(model), "artifact": str(artifact), "modes": modes, "backends": backends}
    return result | {"spec": asdict(open_model_files(model).spec), "parameters_read_per_step": parameters_read_per_step(model)}


def run_demo(
    echo: Callable[[str], None], progress: bool = True, limit: int = DEFAULT_LIMIT, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
) -> dict:
    """Calibrate and inflate (cached), stream one W8A8 generation, then measure both models, once ``needs.py`` agrees."""
    with_ort = unavailable("onnxruntime") is None
    prompts = read_texts(BUILTIN["prompts"])[:limit]
    needs = demo_needs(prompts, max_new_tokens, with_ort)
    check_needs(needs)
    if needs.disk:
        echo(f"first run: the demo needs {needs.describe()}\n")
    if not (demo_artifact_path() / MANIFEST).exists():
        echo("first run: calibrating (cached afterwards)\n")
    artifact = demo_artifact(progress)
    if not all((path / name).exists() for path, name in zip(inflated_demo_paths(), ("config.json", MANIFEST))):
        echo(f"first run: inflating the demo model to the {INFLATED_SHAPE} body shape (cached afterwards)\n")
    big_model, big_artifact = inflated_demo(progress)
    sources = (demo_model_path(), artifact, big_model, big_artifact)
    if with_ort and not all(onnx_export_path(path).exists() for path in sources):
        echo("first run: exporting ONNX Runtime graphs (cached afterwards)\n")

    def stream(engines: dict[str, Engine]) -> None:
        echo(f"--- inflated model, W8A8 verifier, n-gram drafting (k={NUM_DRAFT}, n {NGRAM[0]}..{NGRAM[1]}), streamed ---\n")
        echo(STREAMED_PROMPT)
        for piece in engines["ngram-w8a8"].stream(STREAMED_PROMPT, max_new_tokens=96, draft="ngram"):
            echo(piece)
        echo("\n")

    inflated = _measure(big_model, big_artifact, with_ort, prompts, max_new_tokens, before=stream)
    demo = _measure(demo_model_path(), artifact, with_ort, prompts, max_new_tokens)
    fidelity: Fidelity = evaluate(artifact, demo_model_path(), num_samples=len(read_texts(None, "eval")), progress=False)
    default = auto_backend(open_model_files(big_artifact))
    result = {"inflated": inflated, "demo": demo, "fidelity": fidelity.to_dict(), "artifact": str(artifact), "onnxruntime": with_ort}
    return result | {"prompt_count": len(prompts), "max_new_tokens": max_new_tokens, "default_backend": default}


def _table(measured: dict) -> list[str]:
    modes = measured["modes"]
    rows = [f"  {'mode':<16} {'tokens/s: median (range)':>26} {'accept':>7} {'verify ms':>10} {'vs best float':>14}  backend, kernels"]
    for mode, m in modes.items():
        speed = f"{m['tokens_per_s']:.1f} ({m['tokens_per_s_min']:.1f}-{m['tokens_per_s_max']:.1f})"
        rows.append(
            f"  {mode:<16} {speed:>26} {m['acceptance_length']:>7.2f} {m['verify_step_ms']:>10.2f} "
            f"{m['vs_best_float']:>13.2f}x  {measured['backends'][mode]}"
        )
    return rows


def describe(result: dict) -> str:
    inflated, demo, fid = result["inflated"], result["demo"], result["fidelity"]
    prompts = result["prompt_count"]
    float_modes = "ngram-float and ngram-float-ort" if result["onnxruntime"] else "ngram-float; onnxruntime is not installed"
    s = inflated["spec"]
    hidden, inner, layers, heads, kv_heads, head_dim, vocab, _ = SHAPES[INFLATED_SHAPE]
    rows = [
        f"demo model inflated function-preservingly to the Qwen3-0.6B body shape (the same function: outputs equal the demo model's up to "
        f"float rounding, which can change a token late in a long generation; "
        f"{inflated['parameters_read_per_step'] / 1e6:.1f} M parameters read per step)",
        f"  hidden {s['hidden_size']}, {s['num_layers']} layers, MLP {s['intermediate_size']}, {s['num_heads']} query / "
        f"{s['num_kv_heads']} KV heads of {s['head_dim']} (Qwen3-0.6B: {hidden}, {layers}, {inner}, {heads} / {kv_heads} of {head_dim}), "
        f"vocabulary {s['vocab_size']} (Qwen3-0.6B's {vocab}-row float lm_head, {vocab * hidden / 1e6:.0f} M parameters, not included)",
        *_table(inflated),
        f"demo model itself ({demo['parameters_read_per_step'] / 1e6:.1f} M parameters read per step, in the CPU caches)",
        *_table(demo),
        "",
        f"Each 'vs best float' is the median over {prompts} prompts of the per-prompt ratio of that mode's tokens/s to the "
        f"fastest float mode's on the same prompt ({float_modes}); tokens/s are medians, a backend's modes interleaved prompt "
        f"by prompt, backends one after another (one float model in memory at a time), greedy, {result['max_new_tokens']} "
        f"new tokens, k={NUM_DRAFT}.",
        f"`quasar-deploy generate ARTIFACT` (backend auto) runs W8A8 here on {result['default_backend']} "
        f"(the {'ngram-w8a8-ort' if result['default_backend'] == 'onnxruntime' else 'ngram-w8a8'} rows).",
        f"fidelity of the demo artifact: top-1 agreement with float {fid['top1_agreement']:.4f}, mean KL {fid['mean_kl']:.2e} nats, "
        f"perplexity {fid['ppl_w8a8']:.2f} vs {fid['ppl_float']:.2f}.",
        f"artifacts: {result['artifact']}, {inflated['artifact']}",
    ]
    return "\n".join(rows)
