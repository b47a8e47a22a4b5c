"""What this machine can run: CPU features, the kernels chosen from them, and every target's status."""

from __future__ import annotations

import platform
from pathlib import Path

import torch

from .backends import available_backends
from .kernels import default_float_kernel, default_int8_kernel, fbgemm_available, onednn_available

ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8", "asimd", "asimddp", "i8mm")


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return set(line.split(":", 1)[1].split())
    return set()


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def report() -> dict:
    """Everything ``quasar-deploy doctor`` prints, as data (also recorded in benchmark reports)."""
    flags = cpu_flags()
    targets = {name: reason for name, reason in available_backends().items()}
    if "cuda" not in targets:
        targets["cuda"] = "no CUDA device visible to torch" if not torch.cuda.is_available() else "the cuda backend is not built yet"
    return {
        "cpu": cpu_model(),
        "isa": sorted(f for f in ISA_FLAGS if f in flags),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "fbgemm": fbgemm_available(),
        "onednn": onednn_available(),
        "int8_kernel": default_int8_kernel("cpu"),
        "float_kernel": default_float_kernel("cpu"),
        "targets": targets,
    }
