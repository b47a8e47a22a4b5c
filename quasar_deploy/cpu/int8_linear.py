"""The ``quasar`` int8 kernel: ``int8_linear.c`` (AVX-512 VNNI with AMX tiles where they run, AVX-512 VNNI, AVX-VNNI
or AVX2), compiled here on first use and probed by running it.

At verify sizes a W8A8 linear is a pass over its int8 weights, and the library kernels read them more slowly than their
bf16 kernels read twice the bytes, which took most of W8A8's advantage over a bf16 float model. This kernel streams its
packed weights at close to the memory's rate, computes the scheme's linear bit for bit (``scheme.reference_linear``:
the activation quantization, the exact integer sums and the float epilogue in the reference's order), and is one of the
exact int8 kernels ``kernels.int8_probe`` times: where it runs and is fastest, the cpu backend uses it.

Built and probed as ``cpu_attention`` is (``native``): the builds are tried widest first, and the first whose self-check
passes runs (AMX where Linux grants the tile state, else AVX-512 VNNI, else AVX-VNNI's 256-bit dot products, else
AVX2, which every x86 CPU of the last decade has); where none builds or passes (no compiler, not x86) it is not offered,
and ``why_not`` says why. ``QUASAR_INT8_BUILD`` names the one build to try instead (to time a narrower build on a wider
CPU, or to pin one).
"""

from __future__ import annotations

import ctypes
import functools
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from . import native

SOURCE = Path(__file__).with_name("int8_linear.c")
VNNI_FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vnni", "-ffp-contract=off"]
AVX2_FLAGS = ["-mavx2", "-ffp-contract=off", "-DQUASAR_YMM"]
AMX_BUILD = "cpu_int8-amx"
# name: flags, in order of preference (the same bits in all: exact integer sums): AMX tiles for calls of more than one
# row where the CPU runs them and Linux grants this process their state, else 512-bit VNNI vectors, else 256-bit ones
# (AVX-VNNI), else AVX2's 16-bit pair products with the activations' signs moved onto the weights
BUILDS = {
    AMX_BUILD: [*VNNI_FLAGS, "-mamx-tile", "-mamx-int8", "-DQUASAR_AMX"],
    "cpu_int8-avx512vnni": VNNI_FLAGS,
    "cpu_int8-avxvnni": [*AVX2_FLAGS, "-mavxvnni", "-DQUASAR_AVXVNNI"],
    "cpu_int8-avx2": AVX2_FLAGS,
}
SUMS = {  # how each build sums, for doctor
    AMX_BUILD: "AMX tiles, 512-bit VNNI vectors for a single row",
    "cpu_int8-avx512vnni": "512-bit VNNI vectors",
    "cpu_int8-avxvnni": "256-bit VNNI vectors (AVX-VNNI)",
    "cpu_int8-avx2": "AVX2 16-bit pair products widened to 32 bits, exact",
}
BUILD_ENV = "QUASAR_INT8_BUILD"  # one name of BUILDS: the only build tried
BLOCK = 64  # output columns per packed block, the unit of a thread's share
INTERFACE = 2  # the arguments this module passes the entry points (quasar_int8_interface)
# and, on threads of our own (a process without OpenMP), at least this many rows: up to 8 rows a linear is bound by
# memory, which one core streams about as fast as two, so a second thread of ours only adds its hand-off; torch's
# OpenMP workers, already running, gain at any row count
ROWS_PER_SHARE = 8


@functools.cache
def library() -> tuple[ctypes.CDLL | None, str | None]:
    """The first of ``BUILDS`` (or the one ``QUASAR_INT8_BUILD`` names) that builds and passes its self-check here, once
    per process; or None and why."""
    pinned = os.environ.get(BUILD_ENV)
    if pinned and pinned not in BUILDS:
        return None, f"{BUILD_ENV}={pinned} names no build of it: choose from {', '.join(BUILDS)}"
    reasons = []
    for name in [pinned] if pinned else BUILDS:
        lib, reason = open_build(name)
        if lib is not None:
            return lib, None
        reasons.append(f"{name}: {reason}")
    return None, "; ".join(reasons)


def build() -> str | None:
    """The name of the build ``library`` runs (``BUILDS``), None where none runs."""
    lib = library()[0]
    return None if lib is None else lib.quasar_build


@functools.cache
def open_build(name: str) -> tuple[ctypes.CDLL | None, str | None]:
    """Build ``name`` built and probed (in a child process), its entry points typed, handed the OpenMP runtime torch
    runs on where the process has one (``quasar_int8_use_openmp``); the AMX build granted the tile state in this
    process too. Or None and why."""
    path, reason = native.built_and_probed(SOURCE, name, BUILDS[name])
    if path is None:
        return None, reason
    lib, reason = native.opened(path, "quasar_int8_interface", INTERFACE)
    if lib is None:
        return None, reason
    if name == AMX_BUILD and lib.quasar_int8_enable_amx() != 0:
        return None, "Linux refused this process the AMX tile state"
    lib.quasar_build = name
    pointer, integer, size = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
    lib.quasar_int8_packed_bytes.argtypes, lib.quasar_int8_packed_bytes.restype = [integer, integer], size
    lib.quasar_int8_scratch_bytes.argtypes, lib.quasar_int8_scratch_bytes.restype = [integer, integer], size
    lib.quasar_int8_pack.argtypes, lib.quasar_int8_pack.restype = [pointer, integer, integer, pointer, pointer], None
    lib.quasar_int8_linear.argtypes = [pointer, integer, integer, *[pointer] * 5, integer, integer, integer, pointer, pointer]
    lib.quasar_int8_linear.restype = None
    lib.quasar_int8_linear_shared.argtypes = [pointer, integer, integer, *[pointer] * 5, integer, pointer, integer, pointer, pointer]
    lib.quasar_int8_linear_shared.restype = integer
    native.hand_openmp(lib, "quasar_int8_use_openmp")
    return lib, None


def why_not() -> str | None:
    """Why the kernel is not offered here; None where it runs."""
    return library()[1]


@functools.cache
def _pool(workers: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(workers, thread_name_prefix="quasar-int8")


class PackedInt8Linear:
    """One W8A8 linear on the kernel: the weights packed once (the original can then be released), each call's output
    columns shared between up to ``torch.get_num_threads()`` threads of torch's OpenMP pool (``quasar_int8_linear_shared``;
    where the process has no OpenMP runtime, Python threads of ours), in shares of whole blocks of at least
    ``native.MIN_SHARE_BYTES`` (and, on threads of ours, ``ROWS_PER_SHARE`` rows). A row's result is the same bits
    whatever the rows beside it and whichever thread computed it: its sums are exact integers, its epilogue runs per
    element."""

    def __init__(self, wq: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None, input_scale: torch.Tensor | None):
        lib, reason = library()
        if lib is None:
            raise RuntimeError(f"the quasar kernel does not run here: {reason}")
        self.lib = lib
        self.out_features, self.in_features = wq.shape
        wq = wq.detach().cpu().contiguous()
        self.packed = torch.empty(lib.quasar_int8_packed_bytes(*wq.shape), dtype=torch.int8)
        self.row_sums = torch.empty(self.out_features, dtype=torch.int32)
        lib.quasar_int8_pack(wq.data_ptr(), *wq.shape, self.packed.data_ptr(), self.row_sums.data_ptr())
        self.w_scale = w_scale.detach().float().reshape(-1).contiguous()
        self.bias = None if bias is None else bias.detach().float().reshape(-1).contiguous()
        self.input_scale = None if input_scale is None else input_scale.detach().float().reshape(1).contiguous()
        self.shares = native.BlockShares(-(-self.out_features // BLOCK), wq.numel())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.detach().float().contiguous()
        rows = x.shape[0]
        out = torch.empty(rows, self.out_features)
        shares = min(torch.get_num_threads(), self.shares.most)
        scratch_bytes = self.lib.quasar_int8_scratch_bytes(rows, self.in_features)
        args = (
            x.data_ptr(),
            rows,
            self.in_features,
            self.packed.data_ptr(),
            self.row_sums.data_ptr(),
            self.w_scale.data_ptr(),
            None if self.bias is None else self.bias.data_ptr(),
            None if self.input_scale is None else self.input_scale.data_ptr(),
            self.out_features,
        )
        if shares > 1:
            bounds = self.shares.edges(shares).data_ptr()
            codes = torch.empty(scratch_bytes, dtype=torch.uint8)  # the rows quantized once, read by every share
            if self.lib.quasar_int8_linear_shared(*args, bounds, shares, out.data_ptr(), codes.data_ptr()) == 0:
                return out
        # no OpenMP runtime in the process: threads of our own (ctypes lets go of the GIL), the caller's taking the first,
        # each quantizing the rows into a scratch of its own
        shares = min(shares, -(-rows // ROWS_PER_SHARE))
        scratch = torch.empty(shares, scratch_bytes, dtype=torch.uint8)
        edges = self.shares.edges(shares).tolist()
        run = self.lib.quasar_int8_linear
        pending = [
            _pool(shares - 1).submit(run, *args, edges[t], edges[t + 1], out.data_ptr(), scratch[t].data_ptr()) for t in range(1, shares)
        ]
        run(*args, edges[0], edges[1], out.data_ptr(), scratch[0].data_ptr())
        for future in pending:
            future.result()
        return out
