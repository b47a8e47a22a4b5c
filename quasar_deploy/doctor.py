"""What this machine can run: CPU features, the kernels chosen from them, the GPU, and every target's status."""

from __future__ import annotations

import os
import platform

import torch

from .artifact import ModelFiles, open_model_files
from .backends import available_backends
from .backends.cuda import gpu_status
from .backends.ort_session import bit_exact_int8_entries
from .backends.registry import auto_backend, auto_choice, unavailable
from .cache import cache_dir, entries, size_limit
from .calibration.data import BUILTIN, read_texts
from .cpu import decoder_ops, half_linear, int8_linear
from .cpu.choice import default_int8_kernel, int8_probe
from .cpu.linears import (
    FLOAT_DTYPE_ENV,
    default_float_dtype,
    default_float_kernel,
    dtype_name,
    fbgemm_available,
    float_probe,
    half_probe_ms,
    onednn_available,
    onednn_int8_bit_exact,
    vnni_available,
)
from .cpu.machine import ISA_FLAGS, cpu_flags, cpu_model
from .demo import DEFAULT_LIMIT, DEFAULT_MAX_NEW_TOKENS
from .demo.needs import demo_needs
from .exact_mode import float_source
from .memory import MIB, estimate, report_tokens


def report(path: str | None = None, exact: bool = False, exact_source: str | None = None) -> dict:
    """Everything ``quasar-deploy doctor`` prints, as data; with ``path``, that model's memory too (``exact``: exact mode's)."""
    flags = cpu_flags()
    info = {
        "cpu": cpu_model(),
        "isa": sorted(f for f in ISA_FLAGS if f in flags),
        "threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "unset (the OpenMP runtime's default: spin, then sleep)"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "fbgemm": fbgemm_available(),
        "onednn": onednn_available(),
        "int8_kernel": default_int8_kernel("cpu"),
        "float_kernel": default_float_kernel("cpu"),
        "probes": probes(),
        "gpu": gpu_status(),
        "targets": available_backends(),
        "artifact_backend": auto_choice(artifact=True),
        "checkpoint_backend": auto_choice(artifact=False),
        "layer_skip_backend": auto_choice(artifact=True, needs=("layer_skip",)),  # a W8A8 artifact's
        "layer_skip_checkpoint_backend": auto_choice(artifact=False, needs=("layer_skip",)),
        "cache": cache_summary(),
        "demo": demo_summary(),
    }
    if path is not None:
        files = open_model_files(path)  # verified first: no header is parsed from bytes the manifest does not vouch for
        info |= {"memory": model_memory(files), "auto_backend": auto_backend(files)}
        if exact:
            info["exact_memory"] = exact_memory(files, exact_source)
    return info


def _half_text(half_ms: float | None, float32_ms: float) -> str:
    """What timing the quasar-half kernel showed (``linears.half_probe_ms``), or why it does not run."""
    if half_ms is None:
        return f"16-bit weights widened to float32 by oneDNN (quasar-half: {half_linear.why_not()})"
    return (
        f"16-bit weights read as stored by quasar-half where float32 computes: {half_ms:.3f} ms against oneDNN "
        f"float32's {float32_ms:.3f} at a verify step's shape, half the bytes from memory"
    )


def probes() -> dict:
    """What running the kernels once showed (``kernels``'s probes), and the float dtype chosen from it."""
    probe = float_probe()
    attention = decoder_ops.load()
    chosen = os.environ.get(FLOAT_DTYPE_ENV)
    int8 = int8_probe()
    half = half_probe_ms()
    return {
        "fbgemm_int8_sums_32bit": vnni_available(),
        "onednn_int8_bit_exact": onednn_int8_bit_exact(),
        "quasar_int8_why_not": int8_linear.why_not(),
        "quasar_int8_build": int8_linear.build(),
        "int8_ms": {name: round(ms, 3) for name, ms in int8.ms.items()},
        "int8_kernel_why": int8.reason,
        "onnxruntime_int8_options": [f"{k}={v}" for k, v in bit_exact_int8_entries()] if unavailable("onnxruntime") is None else None,
        "layer_graph_attention": attention.description if attention else "ORT GroupQueryAttention",
        "layer_graph_attention_why": None if attention else decoder_ops.why_not(),
        "float32_ms": round(probe.float32_ms, 3),
        "bfloat16_ms": None if probe.bfloat16_ms is None else round(probe.bfloat16_ms, 3),
        "bf16_invariant_rows": probe.bf16_invariant_rows,
        "bf16_rows": probe.rows_text,
        "half_ms": None if half is None else round(half, 3),
        "half_weights": _half_text(half, probe.float32_ms),
        "float_dtype": dtype_name(default_float_dtype("cpu")),
        "float_dtype_why": f"set by {FLOAT_DTYPE_ENV}={chosen}" if chosen else probe.reason,
    }


def cache_summary() -> dict:
    """The cache's directory, size against its limit, and entries (``quasar-deploy cache list`` names them)."""
    found = entries()
    summary = {"path": str(cache_dir()), "bytes": sum(e.bytes for e in found), "entries": len(found)}
    return summary | {"orphaned": sum(e.orphaned for e in found), "limit": size_limit()}


def demo_summary() -> dict:
    """What ``quasar-deploy demo`` (its default prompts and length) needs here before it starts (``demo.needs``)."""
    needs = demo_needs(read_texts(BUILTIN["prompts"])[:DEFAULT_LIMIT], DEFAULT_MAX_NEW_TOKENS, unavailable("onnxruntime") is None)
    return {**needs.to_dict(), "summary": needs.describe()}


def model_memory(files: ModelFiles) -> dict:
    tokens = report_tokens(files.spec)
    needed = estimate(files)
    return {**needed.to_dict(), "tokens": tokens, "total": needed.total(tokens), "summary": needed.describe(tokens)}


def exact_memory(artifact: ModelFiles, source: str | None = None) -> dict:
    """Exact mode's memory: the float checkpoint's (``source``, default: the one ``artifact`` records), the artifact's, the sum."""
    parts = {"float": model_memory(float_source(artifact, source)), "w8a8": model_memory(artifact)}
    total = sum(part["total"] for part in parts.values())
    summary = (
        f"~{total / MIB:,.0f} MiB with both weight sets resident and both KV caches at {parts['w8a8']['tokens']:,} tokens: "
        f"float {parts['float']['total'] / MIB:,.0f}, W8A8 {parts['w8a8']['total'] / MIB:,.0f} (MiB; plus ~300 MiB of libraries)"
    )
    return {**parts, "total": total, "summary": summary}
