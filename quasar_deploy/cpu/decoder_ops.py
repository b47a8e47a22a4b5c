"""A decoder layer's work around its linears on the CPU: ``decoder_ops.c``, compiled here on first use and probed. It
attends (with the q/k norms and rotary) for ONNX Runtime's layer graphs and the cpu backend, and does the cpu backend's
row-wise ops (RMSNorm, the MLP's SiLU gate: ``TorchRows``).

Unlike ORT's ``GroupQueryAttention``, it attends every sequence of a step in one call per layer, each row's result the
same bits in any company. The widest build (``native``) that passes and takes the head in whole vectors is used.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..decoder_spec import DecoderSpec
from ..model import KEY_CHUNK, round_up
from ..speculative.causal_lm import PREFILL_CHUNK
from . import native

SOURCE = Path(__file__).with_name("decoder_ops.c")
TILE = 16  # keys are stored in tiles of this many positions: [kv_heads][capacity / TILE][head_dim][TILE]
# a thread's share of a step's attention is at least this much work (new rows x positions, summed over kv heads), about
# what handing a share to another thread costs
MIN_SHARE = 20_000
OPENMP_MIN_SHARE = 2_000  # the same in torch's OpenMP pool, whose workers are still spinning and take a share sooner
BUILDS = {16: ["-mavx512f", "-mfma"], 8: ["-mavx2", "-mfma"]}  # floats per vector: the flags that build it


@dataclass(frozen=True)
class Kernel:
    """A built and probed ``decoder_ops.c``: its library and vector width."""

    library: ctypes.CDLL
    width: int
    path: Path
    openmp: bool  # handed the OpenMP runtime torch runs on: ``quasar_attend_shared`` shares a step in torch's pool

    @property
    def description(self) -> str:
        return f"quasar C kernel, {self.width} floats per vector ({'AVX-512' if self.width == 16 else 'AVX2'})"


def load(dim: int | None = None) -> Kernel | None:
    """The widest build this CPU runs that takes heads of ``dim`` floats in whole vectors (any where None), or None."""
    for width in BUILDS:
        kernel, _ = probe(width)
        if kernel is not None and (dim is None or dim % width == 0):
            return kernel
    return None


def why_not(dim: int | None = None) -> str | None:
    """Why the layer graphs attend with ORT's ``GroupQueryAttention`` here; None where the kernel runs."""
    if load(dim) is not None:
        return None
    return "; ".join(probe(w)[1] or f"{w}-wide build: a head of {dim} floats is not whole {w}-float vectors" for w in BUILDS)


@functools.cache
def probe(width: int) -> tuple[Kernel | None, str | None]:
    """The ``width``-wide build, built and its self-check run in a child process, once per process; or None and why."""
    path, reason = native.built_and_probed(SOURCE, f"cpu_attention-{width}", [f"-DW={width}", *BUILDS[width]])
    if path is None:
        return None, f"{width}-wide build: {reason}"
    try:
        library, openmp = _open(path)
    except AttributeError as error:  # a prebuilt library ($QUASAR_KERNELS) from an older source
        return None, f"{width}-wide build: {path} lacks an entry point this version calls ({error}); rebuild it from this version's source"
    return Kernel(library, width, path, openmp), None


def _open(path: Path) -> tuple[ctypes.CDLL, bool]:
    """The library with its entry points typed, handed the OpenMP runtime torch runs on where the process has one."""
    library = ctypes.CDLL(str(path))
    pointer, integer, real = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    library.quasar_attend.argtypes = [integer, integer, *[pointer] * 10, integer, integer, integer, real, pointer, pointer]
    library.quasar_attend.restype = None
    library.quasar_attend_shared.argtypes = [pointer, integer, *[pointer] * 10, integer, integer, integer, real]
    library.quasar_attend_shared.argtypes += [pointer, pointer, ctypes.c_size_t]
    library.quasar_attend_shared.restype = integer
    library.quasar_rows.argtypes = [integer, integer, integer, pointer, pointer, real, pointer, integer, integer]
    library.quasar_rows.restype = None
    return library, native.hand_openmp(library, "quasar_attend_use_openmp")


class Projection(ctypes.Structure):
    """``struct projection`` of the C file: q, k and v as one projection's columns, normed and rotated by the kernel."""

    _fields_ = [(n, ctypes.c_void_p) for n in ("cos", "sin", "q_norm", "k_norm")] + [("eps", ctypes.c_float), ("stride", ctypes.c_int)]


class StepAttention:
    """One step's attention over several sequences, layer after layer: cache pointers, lengths and each thread's share made
    once (``caches[s]``, ``pasts[s]``, ``sizes[s]``: sequence s's caches, past length, new rows), shares split by cost, each
    at least ``MIN_SHARE`` (``OPENMP_MIN_SHARE`` in torch's OpenMP pool, where ``openmp`` and the kernel has it; else ``pool``)."""

    def __init__(
        self,
        kernel: Kernel,
        pool: ThreadPoolExecutor | None,
        threads: int,
        heads: int,
        kv_heads: int,
        dim: int,
        caches: list[list[tuple[np.ndarray, np.ndarray]]],
        pasts: list[int],
        sizes: list[int],
        openmp: bool = False,
    ):
        self.kernel, self.pool, self.heads, self.kv_heads, self.dim = kernel, pool, heads, kv_heads, dim
        self.openmp = openmp and kernel.openmp
        self.caches = caches  # held: the kernel gets raw pointers into these arrays, which must outlive the step
        self.scale = float(dim**-0.5)
        layers = len(caches[0])
        self.keys = np.array([[seq[i][0].ctypes.data for seq in caches] for i in range(layers)], np.int64)
        self.values = np.array([[seq[i][1].ctypes.data for seq in caches] for i in range(layers)], np.int64)
        self.capacities = np.array([seq[0][1].shape[1] for seq in caches], np.int32)
        self.pasts = np.array(pasts, np.int32)
        self.counts = np.array(sizes, np.int32)
        self.starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int32)
        longest = max(p + n for p, n in zip(pasts, sizes))
        cost = np.repeat([n * (p + n) for p, n in zip(pasts, sizes)], kv_heads).astype(np.float64)
        shares = max(1, min(threads, int(cost.sum() // (OPENMP_MIN_SHARE if self.openmp else MIN_SHARE))))
        bounds = np.searchsorted(np.cumsum(cost), np.arange(1, shares) * cost.sum() / shares, side="right")
        edges = sorted({0, *(int(b) for b in bounds), len(cost)})
        self.edges = np.array(edges, np.int32)
        self.shares = list(zip(edges, edges[1:]))
        self.scratch_floats = kernel.library.quasar_scratch_rows() * (longest + TILE)
        self.scratch = np.empty(len(self.shares) * self.scratch_floats, np.float32)

    def __call__(self, layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        """Attention output [rows, heads * dim] of every sequence's new rows q, k, v at ``layer`` (normed, rotated; k, v cached)."""
        q, k, v = (np.ascontiguousarray(a, dtype=np.float32) for a in (q, k, v))
        out = np.empty_like(q)
        self._attend(layer, q.ctypes.data, k.ctypes.data, v.ctypes.data, out, None)
        return out

    def projected(self, layer: int, qkv: np.ndarray, projection: Projection) -> np.ndarray:
        """As a call, from one projection's rows ``qkv`` [rows, (heads + 2 kv_heads) * dim], normed and rotated by the kernel."""
        out = np.empty((qkv.shape[0], self.heads * self.dim), np.float32)
        q = qkv.ctypes.data
        k = q + 4 * self.heads * self.dim
        self._attend(layer, q, k, k + 4 * self.kv_heads * self.dim, out, ctypes.byref(projection))
        return out

    def _attend(self, layer: int, q: int, k: int, v: int, out: np.ndarray, projection) -> None:
        arrays = (out, self.keys[layer], self.values[layer], self.capacities, self.pasts, self.starts, self.counts)
        args = (q, k, v, *(a.ctypes.data for a in arrays), self.heads, self.kv_heads, self.dim, self.scale, projection)
        library, scratch = self.kernel.library, self.scratch.ctypes.data
        if self.openmp and len(self.shares) > 1:
            library.quasar_attend_shared(self.edges.ctypes.data, len(self.shares), *args, scratch, self.scratch_floats)
            return
        # ctypes lets go of the GIL for the call: the shares run side by side
        share_scratch = [scratch + 4 * t * self.scratch_floats for t in range(len(self.shares))]
        pending = [
            self.pool.submit(library.quasar_attend, a, b, *args, share_scratch[t]) for t, (a, b) in enumerate(self.shares[1:], start=1)
        ]
        a, b = self.shares[0]
        library.quasar_attend(a, b, *args, share_scratch[0])
        for future in pending:
            future.result()


def new_caches(layers: int, kv_heads: int, capacity: int, dim: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Zeroed keys and values of a sequence's layers in the kernel's layout, in one anonymous mapping (zeroed by the OS)."""
    floats = kv_heads * capacity * dim  # one layer's keys, or its values
    flat = np.frombuffer(mmap.mmap(-1, 2 * layers * floats * 4), np.float32)
    pairs = (flat[2 * i * floats : (2 * i + 2) * floats] for i in range(layers))
    return [
        (pair[:floats].reshape(kv_heads, capacity // TILE, dim, TILE), pair[floats:].reshape(kv_heads, capacity, dim)) for pair in pairs
    ]


def copy_cache(source: tuple[np.ndarray, np.ndarray], target: tuple[np.ndarray, np.ndarray], length: int) -> None:
    """Positions ``0 .. length`` of one layer into a larger buffer pair (tiles are position-major: whole tiles copy)."""
    tiles = -(-length // TILE)
    target[0][:, :tiles] = source[0][:, :tiles]
    target[1][:, :length] = source[1][:, :length]


class TiledKVCache:
    """One sequence's float32 keys and values in the kernel's layout, with ``model.KVCache``'s life."""

    def __init__(self, spec: DecoderSpec, capacity: int):
        self.spec = spec
        self.length = self.capacity = 0
        self.layers: list[tuple[np.ndarray, np.ndarray]] = []
        self._grow(round_up(capacity, TILE))

    def _grow(self, capacity: int) -> None:
        s = self.spec
        grown = new_caches(s.num_layers, s.num_kv_heads, capacity, s.head_dim)
        for old, new in zip(self.layers, grown):
            copy_cache(old, new, self.length)
        self.layers, self.capacity = grown, capacity

    def reserve(self, extra: int) -> None:
        """Room for ``extra`` more positions (grown to a multiple of ``KEY_CHUNK``, as ``KVCache`` grows)."""
        end = self.length + extra
        if end > self.capacity:
            self._grow(max(2 * self.capacity, round_up(end, KEY_CHUNK)))

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {length}")
        self.length = length


class TorchAttention:
    """The kernel as the torch decoder's attention (``Decoder.attention_kernel``): its caches and, per pass, one
    ``StepAttention`` taking each layer's q/k/v projection, which it norms (``norms``: per layer) and rotates, in float32."""

    itemsize = 4  # bytes of a cached key or value
    prefill_chunk = PREFILL_CHUNK  # a row's bits do not depend on its block, so a prompt may prefill a piece at a time

    def __init__(self, kernel: Kernel, spec: DecoderSpec, threads: int, norms: list[tuple[torch.Tensor | None, torch.Tensor | None]]):
        self.kernel, self.spec, self.threads = kernel, spec, threads
        own_threads = threads > 1 and not kernel.openmp
        self.pool = ThreadPoolExecutor(threads - 1, "quasar-attention") if own_threads else None
        self.norms = [tuple(None if w is None else w.detach().float().contiguous() for w in pair) for pair in norms]

    @property
    def description(self) -> str:
        return self.kernel.description

    def new_cache(self, capacity: int) -> TiledKVCache:
        return TiledKVCache(self.spec, capacity)

    def step(self, caches: list[TiledKVCache], sizes: list[int], cos: torch.Tensor, sin: torch.Tensor):
        """One pass's attention, ``(layer, qkv) -> output``, appending ``sizes[i]`` rows to ``caches[i]`` (room reserved)."""
        s = self.spec
        attend = StepAttention(
            self.kernel, self.pool, self.threads, s.num_heads, s.num_kv_heads, s.head_dim,
            [cache.layers for cache in caches], [cache.length for cache in caches], list(sizes), openmp=True,
        )  # fmt: skip
        return ProjectedStep(attend, cos, sin, self.norms, s.rms_norm_eps)


class ProjectedStep:
    """``TorchAttention``'s ``StepAttention`` for one pass, holding its ``cos`` and ``sin`` (the kernel reads them by address)."""

    def __init__(self, attend: StepAttention, cos: torch.Tensor, sin: torch.Tensor, norms: list, eps: float):
        self.attend = attend
        self.cos, self.sin = (t.float().contiguous() for t in (cos, sin))
        width = (attend.heads + 2 * attend.kv_heads) * attend.dim
        self.projections = [
            Projection(self.cos.data_ptr(), self.sin.data_ptr(), _pointer(q_norm), _pointer(k_norm), eps, width) for q_norm, k_norm in norms
        ]

    def __call__(self, layer: int, qkv: torch.Tensor) -> torch.Tensor:
        rows = qkv.detach().float().contiguous()
        return torch.from_numpy(self.attend.projected(layer, rows.numpy(), self.projections[layer]))


def _pointer(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


RMS_NORM, SILU_GATE = 0, 1  # quasar_rows' ops
ROW_SHARE_FLOATS = 1 << 16  # a row op is shared between the threads from this many floats (below, sharing costs more)


class TorchRows:
    """The kernel's RMSNorm and SiLU gate as the torch decoder's row ops (``Decoder.row_kernel``), one C call each."""

    def __init__(self, kernel: Kernel, threads: int):
        self.library, self.threads = kernel.library, threads
        self._weights: dict[torch.nn.Module, torch.Tensor] = {}  # a norm -> its weight in float32, contiguous

    def _weight(self, norm) -> torch.Tensor:
        if norm not in self._weights:  # a float32 weight is itself: no copy
            self._weights[norm] = norm.weight.detach().float().contiguous()
        return self._weights[norm]

    def _run(self, op: int, x: torch.Tensor, width: int, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        bf16 = x.dtype == torch.bfloat16  # read and written as bf16 by the kernel: no conversion ops around the call
        rows = x.detach().contiguous() if bf16 else x.detach().float().contiguous()
        count = rows.numel() // (2 * width if op == SILU_GATE else width)
        out = torch.empty(count, width, dtype=rows.dtype)
        shares = self.threads if count * width >= ROW_SHARE_FLOATS else 1
        self.library.quasar_rows(op, count, width, rows.data_ptr(), _pointer(weight), eps, out.data_ptr(), int(bf16), shares)
        return out.to(x.dtype)

    def rms_norm(self, x: torch.Tensor, norm) -> torch.Tensor:
        """``norm`` (a ``model.RMSNorm``) of ``x`` [rows, hidden]."""
        return self._run(RMS_NORM, x, x.shape[-1], self._weight(norm), norm.eps)

    def silu_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of ``gate_up`` [rows, 2 * inner]."""
        return self._run(SILU_GATE, gate_up, gate_up.shape[-1] // 2, None, 0.0)
