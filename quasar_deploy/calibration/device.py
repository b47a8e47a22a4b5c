"""Where calibration's forward passes, statistics and alpha search run; what is written always comes back to the host."""

from __future__ import annotations

import torch

from ..backends.npu import unavailable
from ..errors import QuasarError

DEVICES = ("cpu", "cuda", "npu")


def calibration_device(name: str) -> torch.device:
    """``name`` as a torch device, refused in one line naming what is missing (checked before any slow work)."""
    if name not in DEVICES:
        raise QuasarError(f"--device must be one of {', '.join(DEVICES)}, not {name!r}")
    if name == "cuda" and not torch.cuda.is_available():
        raise QuasarError("--device cuda: no CUDA device visible to torch (a CPU-only torch build, or no GPU or driver)")
    if name == "npu":
        why = unavailable()
        if why is not None:
            raise QuasarError(f"--device npu: {why}")
    return torch.device(name)
