"""What ``quasar-deploy demo`` needs before it starts: memory at its peak, and the cache's disk for what its first run writes."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

from .. import demo  # its functions looked up at each call, as the package itself looks up its own
from ..artifact import MANIFEST, open_model_files
from ..backends.onnx_export_cache import onnx_export_path
from ..cache import cache_dir, disk_free
from ..cpu.machine import memory_available
from ..decoder_spec import DecoderSpec, expected_shapes
from ..errors import QuasarError
from ..inflate import inflated_dtype, inflated_spec
from ..memory import MIB, estimate_headers, graph_bytes
from ..shards import TORCH_DTYPES
from ..tokenizer import load_tokenizer
from .measure import NUM_DRAFT

GB = 10**9
LIBRARIES = 320 * MIB  # torch, ONNX Runtime, tokenizers and the interpreter, resident before any model loads
Headers = tuple[dict[str, tuple[int, ...]], dict[str, str]]


@dataclass(frozen=True)
class DemoNeeds:
    memory: int  # peak resident bytes
    disk: int  # bytes the cache still has to write (0 once every entry is there)

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        disk = f"{self.disk / GB:.1f} GB of disk in the cache" if self.disk else "no more disk (cached)"
        return f"~{self.memory / GB:.1f} GB of memory at its peak, {disk}"


def model_headers(spec: DecoderSpec, dtypes: dict[str, str], w8a8: bool) -> Headers:
    """The tensors and stored dtypes of a float checkpoint (``w8a8``: an artifact, int8 linears) of ``spec``."""
    shapes, stored = {}, {}
    for name, shape in expected_shapes(spec).items():
        if not name.endswith(".weight") or (name.startswith("lm_head.") and spec.tie_word_embeddings):
            continue
        shapes[name], stored[name] = shape, inflated_dtype(dtypes, name)
        if w8a8 and name.endswith("_proj.weight"):
            stored[name] = "I8"
            scale = name.removesuffix("weight") + "weight_scale"
            shapes[scale], stored[scale] = (shape[0], 1), "F32"
    return shapes, stored


def _file_bytes(headers: Headers) -> int:
    shapes, dtypes = headers
    return sum(math.prod(shape) * TORCH_DTYPES[dtypes[name]].itemsize for name, shape in shapes.items())


def _engines_bytes(spec: DecoderSpec, float_headers: Headers, w8a8_headers: Headers, tokens: int, with_ort: bool) -> int:
    """The heavier backend's float and W8A8 engines of one model, with ``tokens`` of KV cache each."""
    linears = {name.removesuffix(".weight") for name, dtype in w8a8_headers[1].items() if dtype == "I8"}
    floats = estimate_headers(spec, *float_headers, set(), is_artifact=False)
    w8a8 = estimate_headers(spec, *w8a8_headers, linears, is_artifact=True)
    cpu = floats.total(tokens) + w8a8.total(tokens)
    kv = floats.kv_cache_per_1k_tokens * tokens // 1000  # ONNX Runtime's graphs keep their KV cache in float32 too
    ort = graph_bytes(*float_headers) + graph_bytes(*w8a8_headers) + 2 * kv
    return max(cpu, ort) if with_ort else cpu


def _missing(path: Path, marker: str) -> bool:
    return not (path / marker).exists()


def _export_missing(source: Path, marker: str) -> bool:
    """Whether the ONNX export of ``source`` still has to be made (it cannot exist before its source does)."""
    return _missing(source, marker) or not onnx_export_path(source).exists()


def demo_needs(prompts: list[str], max_new_tokens: int, with_ort: bool) -> DemoNeeds:
    """What ``run_demo`` on ``prompts`` needs here, before it writes or loads anything."""
    source = open_model_files(demo.demo_model_path())
    big = inflated_spec(source.spec, demo.inflation_target())
    dtypes = source.checkpoint.dtypes
    tokenizer = load_tokenizer(source)
    tokens = max(len(tokenizer.encode(p)) for p in prompts) + max_new_tokens + NUM_DRAFT + 1
    small = (model_headers(source.spec, dtypes, False), model_headers(source.spec, dtypes, True))
    inflated = (model_headers(big, dtypes, False), model_headers(big, dtypes, True))
    memory = LIBRARIES + max(_engines_bytes(source.spec, *small, tokens, with_ort), _engines_bytes(big, *inflated, tokens, with_ort))
    artifact, (big_model, big_artifact) = demo.demo_artifact_path(), demo.inflated_demo_paths()
    models = [(demo.demo_model_path(), "config.json", small[0]), (artifact, MANIFEST, small[1])]
    models += [(big_model, "config.json", inflated[0]), (big_artifact, MANIFEST, inflated[1])]
    disk = sum(_file_bytes(headers) for path, marker, headers in models[1:] if _missing(path, marker))  # the demo model ships
    if with_ort:
        disk += sum(graph_bytes(*headers) for path, marker, headers in models if _export_missing(path, marker))
    return DemoNeeds(memory, disk)


def check_needs(needs: DemoNeeds, available: int | None = None, free: int | None = None) -> None:
    """Refuse in one line, before anything is written or loaded, where memory or the cache's disk is short of ``needs``."""
    available = memory_available() if available is None else available
    if needs.memory > available:
        raise QuasarError(
            f"the demo needs ~{needs.memory / GB:.1f} GB of memory at its peak, this machine has {available / GB:.1f} GB available"
        )
    free = disk_free() if free is None else free
    if needs.disk > free:
        raise QuasarError(
            f"the demo's first run writes {needs.disk / GB:.1f} GB to the cache at {cache_dir()}, whose disk has "
            f"{free / GB:.1f} GB free (set QUASAR_CACHE to a larger disk)"
        )
