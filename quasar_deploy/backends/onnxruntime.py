"""The ONNX Runtime backend: runs an ``export --target onnx`` directory behind the ``CausalLM`` interface.

One session serves every step; each step's ``present`` outputs are bound as the next step's ``past`` inputs
(IOBinding: on a GPU they stay on the device), and a rollback slices them.
"""

from __future__ import annotations

import copy
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from ..artifact import ModelFiles
from ..cpu.linears import dtype_name
from ..errors import QuasarError
from ..exporters import ONNX_FORMATS
from ..exporters import ONNX_HEAD_FILE as HEAD_FILE
from ..exporters import ONNX_HIDDEN_OUTPUT as HIDDEN
from ..files import first_line, inside_file, model_directory, read_inside, verified_sha256
from ..integrity import EXPORT_MANIFEST, MANIFEST, read_export_manifest
from ..memory import return_freed_memory
from ..model import Linear, check_finite, held_text
from .onnx_export_cache import cached_onnx_export
from .ort_session import head_beside, session_options, unavailable

CONFIG_FILE = "genai_config.json"
PROVIDERS = {
    "cpu": ["CPUExecutionProvider"],
    "cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"],
    "tensorrt": ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"],
}
GPU_PROVIDERS = ("CUDAExecutionProvider", "TensorrtExecutionProvider")
LAYERED = "layer skipping and batched serving"  # what onnx_layered's graphs give and a whole exported graph has not


def choose_providers(provider: str | None, available: Sequence[str]) -> list[str]:
    """``None``/"auto": CUDA when this onnxruntime build has it, else CPU; a named provider must exist."""
    if provider in (None, "auto"):
        provider = "cuda" if "CUDAExecutionProvider" in available else "cpu"
    if provider not in PROVIDERS:
        raise QuasarError(f"unknown execution provider {provider!r}; choose from auto, {', '.join(PROVIDERS)}")
    wanted = PROVIDERS[provider][0]
    if wanted not in available:
        raise QuasarError(
            f"execution provider {wanted} is not available in this onnxruntime build "
            f"(available: {', '.join(available)}); install onnxruntime-gpu on a machine with an NVIDIA GPU"
        )
    return [p for p in PROVIDERS[provider] if p in available]


def read_config(path: Path) -> tuple[dict, str | None]:
    """The exporter's sidecar and its W8A8 linears' form (None: float graph), once the manifest vouches for every file."""
    path = model_directory(path)
    file = path / CONFIG_FILE
    if inside_file(path, CONFIG_FILE) is None:
        raise QuasarError(f"{path}: no {CONFIG_FILE} (not an ONNX export; run quasar-deploy export --target onnx)")
    record = read_export_manifest(path, "onnx")
    try:
        config = json.loads(read_inside(path, CONFIG_FILE))
        decoder = config["model"]["decoder"]
        int(decoder["num_hidden_layers"]), int(config["model"]["vocab_size"]), str(decoder["filename"])
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError, RecursionError) as exc:
        raise QuasarError(f"{file}: not a valid ONNX export description ({exc.__class__.__name__}: {first_line(exc)})") from None
    if decoder["filename"] not in record["files"] or inside_file(path, decoder["filename"]) is None:
        raise QuasarError(f"{path}: {decoder['filename']!r} is missing (the graph must be a file its manifest lists)")
    # exports written before the qdq form existed carry no linear_format: their W8A8 graphs are integer ones
    w8a8 = config.get("quasar", {}).get("precision") == "w8a8"
    linear_format = record.get("linear_format", "integer" if w8a8 else None)
    if linear_format not in (ONNX_FORMATS if w8a8 else (None,)):
        raise QuasarError(f"{path / EXPORT_MANIFEST}: linear_format {linear_format!r} does not fit a {'W8A8' if w8a8 else 'float'} graph")
    return config, linear_format


def mismatch_note(provider: str, linear_format: str | None) -> str | None:
    """Why ``provider`` will not run this graph's linears as int8 GEMMs on the GPU, if it will not (None: it will, or CPU)."""
    if provider not in GPU_PROVIDERS or linear_format is None:
        return None
    if linear_format == "integer":
        return (
            f"the integer graph's u8 x s8 MatMulInteger has no {provider} kernel (ORT's CUDA kernel takes int8 x int8, "
            "TensorRT none): ONNX Runtime runs those nodes on the CPU; export --format qdq for TensorRT"
        )
    if provider == "CUDAExecutionProvider":
        return "ORT's CUDA provider runs the QDQ graph as float math on dequantized weights (no int8 GEMM); provider tensorrt fuses it"
    return None


def context_length(config: dict) -> int:
    """The longest sequence the export serves (onnxruntime-genai layouts put it in ``search.max_length`` too)."""
    return int(config["model"].get("context_length") or config.get("search", {}).get("max_length"))


def cache_names(config: dict, kind: str) -> list[tuple[str, str]]:
    """(key, value) names of every layer's ``past`` inputs or ``present`` outputs, as the sidecar spells them."""
    decoder = config["model"]["decoder"]
    names = decoder["inputs" if kind == "past" else "outputs"]
    return [(names[f"{kind}_key_names"] % i, names[f"{kind}_value_names"] % i) for i in range(int(decoder["num_hidden_layers"]))]


def tensorrt_options(config: dict, block: int = 6) -> dict[str, object]:
    """TensorRT provider options: INT8 on (it then honours the Q/DQ layers), and one optimization profile over every length
    up to the context window (else TensorRT rebuilds its engine as the cache grows), tuned for a ``block``-token verify."""
    decoder, context = config["model"]["decoder"], context_length(config)
    heads, dim = int(decoder["num_key_value_heads"]), int(decoder["head_size"])

    def shapes(sequence: int, past: int, total: int) -> str:
        cache = [f"{name}:1x{heads}x{past}x{dim}" for pair in cache_names(config, "past") for name in pair]
        return ",".join([f"input_ids:1x{sequence}", f"position_ids:1x{sequence}", f"attention_mask:1x{total}", *cache])

    past = max(0, min(512, context - block))
    return {
        "trt_int8_enable": True,
        "trt_profile_min_shapes": shapes(1, 0, 1),
        "trt_profile_opt_shapes": shapes(block, past, past + block),
        "trt_profile_max_shapes": shapes(context, context, context),
    }


def head_outside(config: dict) -> bool:
    """Whether the graph ends in ``hidden_states``, its float lm_head computed beside it (``load_head``)."""
    return HIDDEN in config["model"]["decoder"]["outputs"]


def load_head(directory: Path) -> tuple[Linear, str]:
    """The lm_head stored beside a graph that ends in ``hidden_states``, on torch (``head_beside``), and its dtype's name."""
    tensors = load_file(str(directory / HEAD_FILE))
    for name, tensor in tensors.items():
        check_finite(f"{HEAD_FILE}:{name}", tensor)
    head = head_beside(tensors["weight"], tensors.get("bias"))
    return head, dtype_name(head.dtype)


class OnnxCausalLM:
    """Batch-1 ``CausalLM`` over an exported decoder graph; with ``head``, the lm_head after a ``hidden_states`` graph."""

    def __init__(self, session, config: dict, provider: str, linear_format: str | None, head: tuple[Linear, str] | None = None):
        model = config["model"]
        decoder = model["decoder"]
        self.session = session
        self._head, head_dtype = head or (None, "")
        self._output = HIDDEN if self._head is not None else "logits"
        self.provider = provider
        self.vocab_size = int(model["vocab_size"])
        self.max_length = context_length(config)
        self.num_layers = int(decoder["num_hidden_layers"])
        self._kv_shape = (1, int(decoder["num_key_value_heads"]), 0, int(decoder["head_size"]))
        self._past, self._present = cache_names(config, "past"), cache_names(config, "present")
        self._device = "cuda" if provider in GPU_PROVIDERS else "cpu"
        self._check_graph()
        self.linear_format = linear_format
        threads = session.get_session_options().intra_op_num_threads
        graph = f"W8A8 {linear_format}" if linear_format else "float"
        beside = f", {head_dtype} lm_head on torch{held_text(self._head)}" if self._head is not None else ""
        self.description = f"onnxruntime {provider} ({graph} graph{beside}), {threads} threads"
        self._cache: list = []
        self.truncate(0)

    def _check_graph(self) -> None:
        """A graph that does not match its sidecar (layers, heads, vocabulary) is refused before it runs."""
        inputs = {i.name: i.shape for i in self.session.get_inputs()}
        outputs = {o.name: o.shape for o in self.session.get_outputs()}
        expected_in = {"input_ids", "attention_mask", "position_ids", *(n for pair in self._past for n in pair)}
        expected_out = {self._output, *(n for pair in self._present for n in pair)}
        if set(inputs) != expected_in or set(outputs) != expected_out:
            differ = sorted((set(inputs) ^ expected_in) | (set(outputs) ^ expected_out))
            raise QuasarError(f"the ONNX graph does not match {CONFIG_FILE}: inputs/outputs differ at {', '.join(differ[:3])}")
        key = inputs[self._past[0][0]]
        vocab = self._head.out_features if self._head is not None else outputs["logits"][-1]
        if key[1] != self._kv_shape[1] or key[3] != self._kv_shape[3] or vocab != self.vocab_size:
            raise QuasarError(f"the ONNX graph does not match {CONFIG_FILE}: cache {key} or vocabulary {vocab} differ")

    def _ortvalue(self, array: np.ndarray):
        from onnxruntime import OrtValue  # optional: onnxruntime

        return OrtValue.ortvalue_from_numpy(np.ascontiguousarray(array), self._device, 0)

    def _run(self, ids: Sequence[int], last_only: bool = False) -> torch.Tensor:
        """The logits of ``ids`` appended to the cache (only the last row's with ``last_only``)."""
        out = torch.from_numpy(self._forward(ids))
        out = out[-1:] if last_only else out
        return (self._head(out) if self._head is not None else out.clone() if last_only else out).float()

    def _forward(self, ids: Sequence[int]) -> np.ndarray:
        if len(ids) == 0:
            raise ValueError("no tokens to run")
        start, n = self.length, len(ids)
        if start + n > self.max_length:
            raise QuasarError(f"sequence of {start + n} tokens exceeds the context window ({self.max_length})")
        binding = self.session.io_binding()
        binding.bind_cpu_input("input_ids", np.asarray([ids], dtype=np.int64))
        binding.bind_cpu_input("position_ids", np.arange(start, start + n, dtype=np.int64)[None])
        binding.bind_cpu_input("attention_mask", np.ones((1, start + n), dtype=np.int64))
        for (key, value), (cached_key, cached_value) in zip(self._past, self._cache):
            binding.bind_ortvalue_input(key, cached_key)
            binding.bind_ortvalue_input(value, cached_value)
        binding.bind_output(self._output, "cpu")
        for key, value in self._present:
            binding.bind_output(key, self._device)
            binding.bind_output(value, self._device)
        self.session.run_with_iobinding(binding)
        logits, *present = binding.get_outputs()
        self._cache = list(zip(present[0::2], present[1::2]))
        self._length = start + n
        return logits.numpy()[0]

    def prefill(self, ids: Sequence[int]) -> torch.Tensor:
        self.truncate(0)
        return self._run(ids, last_only=True)[0]

    def verify(self, ids: Sequence[int]) -> torch.Tensor:
        return self._run(ids)

    def truncate(self, length: int) -> None:
        if length == 0:
            empty = np.zeros(self._kv_shape, dtype=np.float32)
            self._cache = [(self._ortvalue(empty), self._ortvalue(empty)) for _ in range(self.num_layers)]
        elif not 0 < length <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {length}")
        elif length < self.length:
            self._cache = [tuple(self._ortvalue(v.numpy()[:, :, :length]) for v in pair) for pair in self._cache]
        self._length = length

    def new_sequence(self) -> OnnxCausalLM:
        """The same ORT session (one graph, one set of weights) with a fresh cache; the graph was checked once already."""
        other = copy.copy(self)
        other._cache = []
        other.truncate(0)
        return other

    @property
    def length(self) -> int:
        return self._length

    @property
    def device(self) -> str:
        """Where the KV cache lives: "cuda" on a GPU provider, else "cpu"."""
        return self._device

    def kv_cache_bytes(self, tokens: int) -> int:
        """Twice a sequence's float32 cache at ``tokens`` positions (a rollback holds the sliced copy beside the old one)."""
        _, heads, _, dim = self._kv_shape
        return 2 * (2 * self.num_layers * heads * dim * 4 * tokens)


def cached_export(files: ModelFiles) -> tuple[Path, dict, str | None]:
    """An opened artifact's or checkpoint's export from the cache (made on first use, again if damaged) with its checked
    config; the export must name the manifest it was built from (``source_manifest_sha256``)."""
    built_from = verified_sha256(files.path / MANIFEST) if files.is_artifact else None
    path = cached_onnx_export(files)
    try:
        return path, *check_built_from(path, built_from)
    except QuasarError as exc:
        print(f"warning: the cached ONNX export is damaged ({exc}); exporting it again", file=sys.stderr)
    path = cached_onnx_export(files, replace=True)
    return path, *check_built_from(path, built_from)


def check_built_from(path: Path, manifest_sha256: str | None) -> tuple[dict, str | None]:
    """``read_config`` of the export at ``path``, refused unless it records the source manifest's sha256 it should."""
    config, linear_format = read_config(path)
    if config.get("quasar", {}).get("source_manifest_sha256") != manifest_sha256:
        raise QuasarError(f"{path}: exported from another artifact than the one it is cached for")
    return config, linear_format


def load_onnx(files: ModelFiles, provider: str | None = None, threads: int | None = None, needs: Sequence[str] = ()):
    """An opened artifact or checkpoint on ORT through its cached export (``load_onnx_export``); ``needs`` ("layer_skip") gets
    a W8A8 artifact as ``onnx_layered``'s batched layer graphs (a whole graph has neither)."""
    if needs:
        return _load_layered(files, provider, threads)
    return _load_graph(*cached_export(files), provider, threads)


def load_onnx_export(directory: Path, provider: str | None = None, threads: int | None = None, needs: Sequence[str] = ()):
    """An ONNX export on ORT (its directory: an export is no ``ModelFiles``); ``provider``: auto, cpu, cuda or tensorrt."""
    if needs:
        raise QuasarError(f"{directory}: an export runs as one whole graph, without {LAYERED}; load the artifact it came from")
    return _load_graph(directory, *read_config(directory), provider, threads)


def _load_graph(path: Path, config: dict, linear_format: str | None, provider: str | None, threads: int | None) -> OnnxCausalLM:
    """The graph of the export at ``path`` (its ``read_config``) in an ORT session on ``provider``."""
    reason = unavailable()
    if reason is not None:
        raise QuasarError(reason)
    import onnxruntime as ort  # optional: onnxruntime

    providers = choose_providers(provider, ort.get_available_providers())
    options = session_options(threads, head_on_torch=head_outside(config))
    try:
        with_options = [(name, tensorrt_options(config) if name == "TensorrtExecutionProvider" else {}) for name in providers]
        session = ort.InferenceSession(str(path / config["model"]["decoder"]["filename"]), options, providers=with_options)
    except Exception as exc:  # ORT raises its own exception types (InvalidProtobuf, Fail, ...) for a bad file
        raise QuasarError(f"{path}: ONNX Runtime cannot load the graph ({first_line(exc)})") from None
    running = session.get_providers()[0]
    if running != providers[0]:  # ORT's Python API falls back to the next provider when one fails to start
        raise QuasarError(f"{providers[0]} did not start (ONNX Runtime fell back to {running}); check its libraries (CUDA, TensorRT)")
    return_freed_memory()
    note = mismatch_note(running, linear_format)
    if note is not None:
        print(f"warning: {note}", file=sys.stderr)
    head = load_head(path) if head_outside(config) else None
    return OnnxCausalLM(session, config, running, linear_format, head)


def _load_layered(files: ModelFiles, provider: str | None, threads: int | None):
    """``onnx_layered``'s batched layer graphs of the opened artifact ``files``, refused in one line where they cannot run."""
    from .onnx_layered import load_layered  # optional: onnx

    if provider not in (None, "auto", "cpu"):
        raise QuasarError(f"{LAYERED} on ONNX Runtime run on its cpu provider, not {provider}")
    return load_layered(files, threads, progress=sys.stderr.isatty())
