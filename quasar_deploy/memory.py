"""What a model needs in memory once loaded on the CPU backend, from its tensor headers alone (no weight is read),
and what this process holds now: the figures ``doctor PATH`` and ``generate --stats`` print."""

from __future__ import annotations

import ctypes
import math
import os
from collections.abc import Collection, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from .cpu.linears import default_float_dtype, half_weights
from .decoder_spec import DecoderSpec
from .shards import TORCH_DTYPES

if TYPE_CHECKING:  # annotations only
    import torch

    from .checkpoint import Checkpoint


class OpenedModel(Protocol):
    """What ``estimate`` reads of an opened model directory (``artifact.ModelFiles``, not imported here)."""

    checkpoint: Checkpoint
    spec: DecoderSpec
    manifest: dict | None

    @property
    def is_artifact(self) -> bool: ...


MIB = 1 << 20
MEMORY_REPORT_TOKENS = 4096  # the KV cache length that reports and the backend choice size a model's memory at
COMPUTE_ITEMSIZE = 4  # float32: a W8A8 decoder's activations, and float parts where bf16 is slow
EMBEDDINGS = "model.embed_tokens.weight"


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes by kind, as the cpu backend holds them: one packed copy of each weight (``Linear.release_weight``)."""

    int8_weights: int  # int8 weights and their scales
    float_weights: int  # float linears, a float lm_head (a tied one too: its packed copy) and norms, as computed
    embeddings: int  # a table converted on load (one kept as stored is read in place from its file: 0)
    kv_cache_per_1k_tokens: int

    def total(self, tokens: int) -> int:
        return self.int8_weights + self.float_weights + self.embeddings + self.kv_cache_per_1k_tokens * tokens // 1000

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self, tokens: int) -> str:
        """One line: the parts and their sum with a ``tokens``-token KV cache."""
        in_place = "" if self.embeddings else " (read in place from the file)"
        return (
            f"~{self.total(tokens) / MIB:,.0f} MiB with {tokens:,} tokens of KV cache: int8 weights {self.int8_weights / MIB:,.0f}, "
            f"float weights {self.float_weights / MIB:,.0f}, embeddings {self.embeddings / MIB:,.0f}{in_place}, "
            f"KV cache {self.kv_cache_per_1k_tokens / MIB:,.1f} per 1,000 tokens (MiB; plus ~300 MiB of libraries)"
        )


def estimate(files: OpenedModel, float_dtype: torch.dtype | None = None) -> MemoryEstimate:
    """The cpu backend's resident weights and KV cache for ``files``, float parts in ``float_dtype`` (default: this CPU's)."""
    ckpt = files.checkpoint
    quantized = set(files.manifest["quantized_layers"]) if files.manifest else set()
    return estimate_headers(files.spec, ckpt.shapes, ckpt.dtypes, quantized, files.is_artifact, float_dtype)


def estimate_headers(
    spec: DecoderSpec,
    shapes: Mapping[str, Sequence[int]],
    dtypes: Mapping[str, str],
    quantized: Collection[str],
    is_artifact: bool,
    float_dtype: torch.dtype | None = None,
) -> MemoryEstimate:
    """``estimate`` from tensor headers (name -> shape, safetensors dtype name), also of a model not written yet."""
    head_dtype = float_dtype or default_float_dtype("cpu")
    body = COMPUTE_ITEMSIZE if is_artifact else head_dtype.itemsize

    def held(name: str) -> int:
        """Bytes per value of a head's weight as its kernel holds it: as stored where ``quasar-half`` runs it."""
        stored = TORCH_DTYPES[dtypes[name]]
        return stored.itemsize if half_weights(stored, head_dtype, "onednn") else head_dtype.itemsize

    int8 = floats = embeddings = 0
    for name, shape in shapes.items():
        count = math.prod(shape)
        if name == EMBEDDINGS:  # read in place where no wider than the body's dtype (model.embedding_table); a tied head packs its own copy
            embeddings = 0 if TORCH_DTYPES[dtypes[name]].itemsize <= body else count * body
            if spec.tie_word_embeddings:
                floats += count * held(name)
        elif name.rsplit(".", 1)[0] in quantized:
            int8 += count * TORCH_DTYPES[dtypes[name]].itemsize
        else:
            floats += count * (held(name) if name == "lm_head.weight" else head_dtype.itemsize if name.startswith("lm_head.") else body)
    return MemoryEstimate(int8, floats, embeddings, kv_cache_bytes(spec, 1000, body))


def head_dtype_name(dtypes: Mapping[str, str]) -> str:
    """The safetensors dtype name the lm_head is stored in, or the embedding table it is tied to, from tensor headers."""
    return dtypes.get("lm_head.weight", dtypes.get(EMBEDDINGS, "F32"))


def graph_bytes(shapes: Mapping[str, Sequence[int]], dtypes: Mapping[str, str]) -> int:
    """What an ONNX export's initializers weigh, from tensor headers: int8 weights as int8, every float tensor as float32."""
    return sum(math.prod(shape) * (1 if dtypes[name] == "I8" else 4) for name, shape in shapes.items())


def report_tokens(spec: DecoderSpec) -> int:
    """``MEMORY_REPORT_TOKENS``, or the context window where that is shorter."""
    return min(MEMORY_REPORT_TOKENS, spec.max_position_embeddings)


def kv_cache_bytes(spec: DecoderSpec, tokens: int, itemsize: int = COMPUTE_ITEMSIZE) -> int:
    """Keys and values of every layer for ``tokens`` positions: what the cache holds, and what a step reads of it."""
    return 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * itemsize * tokens


def resident() -> dict[str, float]:
    """This process's resident set now, in MiB: all of it (VmRSS) and its anonymous part (RssAnon). Empty off Linux."""
    try:
        with open("/proc/self/status") as status:
            fields = dict(line.split(":", 1) for line in status if line.startswith(("VmRSS", "RssAnon")))
    except OSError:
        return {}
    return {f"{key.lower()}_mib": int(value.split()[0]) / 1024 for key, value in fields.items()}


def tree_resident_mib(pid: int | None = None) -> float:
    """The resident set of process ``pid`` (default: this one) and all its descendants, in MiB; 0 off Linux."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # a process that has just exited
            continue
        parents[int(entry.name)] = int(stat[stat.rindex(")") + 2 :].split()[1])  # the name, in parentheses, may hold spaces
    tree = {pid or os.getpid()}
    while children := {child for child, parent in parents.items() if parent in tree} - tree:
        tree |= children
    kib = 0
    for member in tree:
        try:
            status = Path(f"/proc/{member}/status").read_text().splitlines()
        except OSError:
            continue
        kib += sum(int(line.split()[1]) for line in status if line.startswith("VmRSS"))
    return kib / 1024


def return_freed_memory() -> None:
    """Hand the heap that loading freed back to the OS (glibc keeps freed chunks of a few MB otherwise)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to hand back this way
        pass
