"""The ``quasar`` int8 kernel: ``int8_linear.c`` (AVX-512 VNNI with AMX tiles where they run, AVX-512 VNNI, AVX-VNNI
or AVX2), compiled here on first use and probed by running it.

It streams packed weights at close to the memory's rate (the library kernels read them slowly), bit-exact with
``scheme.reference_linear``. The widest build whose self-check passes runs; ``QUASAR_INT8_BUILD`` pins one.
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
# name: flags, in order of preference (the same bits in all: integer-exact sums)
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
    "cpu_int8-avx2": "AVX2 16-bit pair products widened to 32 bits, bit-exact",
}
BUILD_ENV = "QUASAR_INT8_BUILD"  # one name of BUILDS: the only build tried
BLOCK = 64  # output columns per packed block, the unit of a thread's share
INTERFACE = 2  # the arguments this module passes the entry points (quasar_int8_interface)
ROWS_PER_SHARE = 8  # on threads of our own (no OpenMP), a share has at least this many rows: below, one core streams as fast


@functools.cache
def library() -> tuple[ctypes.CDLL | None, str | None]:
    """The first of ``BUILDS`` (or ``QUASAR_INT8_BUILD``'s) that builds and passes its self-check here; or None and why."""
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
    """Build ``name`` built, probed and opened, handed torch's OpenMP runtime (AMX: the tile state); or None and why."""
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
    """One W8A8 linear on the kernel: weights packed once, each call's output columns shared between torch's OpenMP threads
    (else Python threads of ours) in ``native.BlockShares``; a row's result is the same bits whatever its company."""

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
        weights = [None if t is None else t.data_ptr() for t in (self.packed, self.row_sums, self.w_scale, self.bias, self.input_scale)]
        args = (x.data_ptr(), rows, self.in_features, *weights, self.out_features)
        if shares > 1:
            bounds = self.shares.edges(shares).data_ptr()
            codes = torch.empty(scratch_bytes, dtype=torch.uint8)  # the rows quantized once, read by every share
            if self.lib.quasar_int8_linear_shared(*args, bounds, shares, out.data_ptr(), codes.data_ptr()) == 0:
                return out
        # no OpenMP runtime: threads of our own (ctypes lets go of the GIL), each quantizing the rows into its own scratch
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
