"""The ``quasar-half`` float kernel: ``half_linear.c``, a float32 linear over weights kept in 16 bits (bf16 or float16),
widened exactly in registers; compiled here on first use and probed by running it (``native``).

Where float parts compute in float32, a library kernel reads a 16-bit weight as a float32 copy, twice the bytes; this
one reads it as stored (``linears.half_weights``). One build (AVX2, FMA, F16C).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from . import native

SOURCE = Path(__file__).with_name("half_linear.c")
NAME = "cpu_half-avx2"
FLAGS = ["-mavx2", "-mfma", "-mf16c", "-ffp-contract=off"]
COLS = 16  # output columns per packed block, the unit of a thread's share
INTERFACE = 1  # the arguments this module passes the entry points (quasar_half_interface)
FORMATS = {torch.bfloat16: 1, torch.float16: 0}  # the stored dtypes it widens, as the C calls name them


@functools.cache
def library() -> tuple[ctypes.CDLL | None, str | None]:
    """The build, built and probed, its entry points typed and handed torch's OpenMP runtime; or None and why."""
    path, reason = native.built_and_probed(SOURCE, NAME, FLAGS)
    if path is None:
        return None, f"{NAME}: {reason}"
    lib, reason = native.opened(path, "quasar_half_interface", INTERFACE)
    if lib is None:
        return None, reason
    pointer, integer, size = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
    lib.quasar_half_packed_bytes.argtypes, lib.quasar_half_packed_bytes.restype = [integer, integer], size
    lib.quasar_half_pack.argtypes, lib.quasar_half_pack.restype = [pointer, integer, integer, pointer], None
    lib.quasar_half_scratch_bytes.argtypes, lib.quasar_half_scratch_bytes.restype = [integer, integer], size
    lib.quasar_half_linear.argtypes = [pointer, integer, integer, pointer, pointer, integer, integer, integer, integer, pointer, pointer]
    lib.quasar_half_linear.restype = None
    lib.quasar_half_linear_shared.argtypes = [pointer, integer, integer, *[pointer] * 2, *[integer] * 2, pointer, integer, *[pointer] * 2]
    lib.quasar_half_linear_shared.restype = integer
    native.hand_openmp(lib, "quasar_half_use_openmp")
    return lib, None


def why_not() -> str | None:
    """Why the kernel is not offered here; None where it runs."""
    return library()[1]


class HalfWeightLinear:
    """One float32 linear over a bf16 or float16 weight packed once as stored, shared among threads; row-invariant."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        lib, reason = library()
        if lib is None:
            raise RuntimeError(f"the quasar-half kernel does not run here: {reason}")
        if weight.dtype not in FORMATS:
            raise ValueError(f"quasar-half widens bf16 or float16 weights, not {weight.dtype}")
        self.lib, self.format = lib, FORMATS[weight.dtype]
        self.out_features, self.in_features = weight.shape
        weight = weight.detach().cpu().contiguous()
        self.packed = torch.empty(lib.quasar_half_packed_bytes(*weight.shape) // 2, dtype=torch.int16)
        lib.quasar_half_pack(weight.data_ptr(), *weight.shape, self.packed.data_ptr())
        self.bias = None if bias is None else bias.detach().float().reshape(-1).contiguous()
        self.shares = native.BlockShares(-(-self.out_features // COLS), weight.numel() * weight.element_size())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.detach().float().contiguous()
        rows = x.shape[0]
        out = torch.empty(rows, self.out_features)
        shares = min(torch.get_num_threads(), self.shares.most)
        bias = None if self.bias is None else self.bias.data_ptr()
        args = (x.data_ptr(), rows, self.in_features, self.packed.data_ptr(), bias, self.out_features, self.format)
        # each thread's block widened to float32 where the rows take several passes (quasar_half_scratch_bytes)
        scratch = torch.empty(shares, self.lib.quasar_half_scratch_bytes(rows, self.in_features) // 4)
        outputs = (out.data_ptr(), scratch.data_ptr())
        if shares > 1 and self.lib.quasar_half_linear_shared(*args, self.shares.edges(shares).data_ptr(), shares, *outputs) == 0:
            return out
        self.lib.quasar_half_linear(*args, 0, self.shares.blocks, *outputs)  # one share, or no OpenMP runtime here
        return out
