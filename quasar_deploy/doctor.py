"""What this machine can run: CPU features, the kernels chosen from them, and every target's status."""

from __future__ import annotations

import os
import platform

import torch

from .backends import available_backends
from .backends.registry import default_backend
from .cpuinfo import ISA_FLAGS, cpu_flags, cpu_model
from .kernels import default_float_kernel, default_int8_kernel, fbgemm_available, onednn_available


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
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "unset (the OpenMP runtime's default: spin, then sleep)"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "fbgemm": fbgemm_available(),
        "onednn": onednn_available(),
        "int8_kernel": default_int8_kernel("cpu"),
        "float_kernel": default_float_kernel("cpu"),
        "targets": targets,
        "default_backend": default_backend(),
    }
