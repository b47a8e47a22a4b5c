"""ONNX Runtime on the CPU, batched: a W8A8 artifact as per-layer graphs over stacked rows (``exporters/onnx_layers``).

Unlike the whole-graph export, it verifies several sequences in one step (rows stacked through each layer's graphs, a
row's values independent of its neighbours: a ``BatchVerifyingLM``), skips layers, and rolls back without copies.
Attention runs in ``decoder_ops``' C kernel where it runs, else in ORT's ``GroupQueryAttention`` per sequence (a process
uses one throughout: they round differently). The float lm_head runs beside the graphs on torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import onnxruntime as ort
import torch
from onnxruntime import OrtValue
from tqdm import tqdm

from ..artifact import HEAD, ModelFiles
from ..cpu import decoder_ops
from ..cpu.linears import dtype_name
from ..decoder_spec import rope_inv_freq
from ..errors import QuasarError
from ..exporters import onnx_layers
from ..memory import EMBEDDINGS, kv_cache_bytes, return_freed_memory
from ..model import KEY_CHUNK, DecoderLayer, RMSNorm, as_stored, held_text, load_linear, rotary, round_up, tensor_loader
from ..speculative.causal_lm import PREFILL_CHUNK, split_batch
from .ort_session import head_beside, session_options

ROTARY_CHUNK = 1024  # rotary tables are made for fixed chunks of positions, so a position's cos/sin are always the same bits
ATTENTIONS = ("auto", "ort")


def unsupported(files: ModelFiles) -> str | None:
    """Why ``files`` cannot run as layer graphs (None: it can): every layer linear must be W8A8, attention plain causal."""
    if not files.is_artifact:
        return "a float checkpoint (the layer graphs are W8A8)"
    float_linears = [name for name in files.spec.linear_names() if name not in set(files.manifest["quantized_layers"])]
    if float_linears:
        return f"its linear {float_linears[0]!r} is not W8A8"
    if files.spec.sliding_window is not None:
        return "its attention has a sliding window"
    return None


class RotaryTable:
    """cos/sin rows by position, computed ``ROTARY_CHUNK`` positions at a time as ``model.rotary`` does and kept."""

    def __init__(self, inv_freq: torch.Tensor):
        self.inv_freq = inv_freq
        self._chunks: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def rows(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        chunk_of = positions // ROTARY_CHUNK
        width = 2 * self.inv_freq.shape[0]
        cos, sin = np.empty((len(positions), width), np.float32), np.empty((len(positions), width), np.float32)
        for chunk in np.unique(chunk_of).tolist():
            if chunk not in self._chunks:
                c, s = rotary(self.inv_freq, chunk * ROTARY_CHUNK, ROTARY_CHUNK, torch.float32)
                self._chunks[chunk] = c.numpy(), s.numpy()
            here = chunk_of == chunk
            offsets = positions[here] - chunk * ROTARY_CHUNK
            cos[here], sin[here] = self._chunks[chunk][0][offsets], self._chunks[chunk][1][offsets]
        return cos, sin


class LayeredModel:
    """What every sequence shares: the sessions, the embedding table, the float head and the rotary table."""

    def __init__(self, files: ModelFiles, threads: int | None = None, progress: bool = True, attention: str = "auto"):
        """``attention``: "auto" (the C kernel where it runs, else ORT's) or "ort" (ORT's ``GroupQueryAttention``, a bench contender)."""
        if attention not in ATTENTIONS:
            raise ValueError(f"attention is one of {', '.join(ATTENTIONS)}, not {attention!r}")

        spec, source = files.spec, files.checkpoint
        self.spec = spec
        self.prefill_chunk = PREFILL_CHUNK
        int8_head = f"{HEAD}.weight_scale" in source.names
        options = session_options(threads, head_on_torch=not int8_head)
        self.threads = options.intra_op_num_threads

        def session(model: bytes):
            return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])

        load = tensor_loader(source, torch.float32)
        self.inputs, self.outputs = [], []
        for i in tqdm(range(spec.num_layers), desc="building onnx layers", unit="layer", disable=not progress):
            layer = DecoderLayer(spec, load, spec.layer_prefix(i))
            self.inputs.append(session(onnx_layers.attention_inputs(spec, layer, i)))
            self.outputs.append(session(onnx_layers.layer_output(spec, layer, i)))
            del layer
            return_freed_memory()
        self.kernel = kernel = decoder_ops.load(spec.head_dim) if attention == "auto" else None
        self.pool = ThreadPoolExecutor(self.threads - 1, "quasar-attention") if kernel and self.threads > 1 else None
        self.attention = session(onnx_layers.attention(spec)) if kernel is None else None
        self.final_norm = session(onnx_layers.final_norm(spec, RMSNorm(load("model.norm.weight"), spec.rms_norm_eps)))
        self.table = as_stored(source, EMBEDDINGS, torch.float32)
        if int8_head:
            self.int8_head, self.float_head = session(onnx_layers.int8_head(spec, load_linear(load, HEAD))), None
            head = "int8 lm_head graph"
        else:
            weight = self.table if spec.tie_word_embeddings else as_stored(source, f"{HEAD}.weight", torch.float32)
            self.int8_head, self.float_head = None, head_beside(weight, load(f"{HEAD}.bias", False))
            head = f"{dtype_name(self.float_head.dtype)} lm_head on torch{held_text(self.float_head)}"
        self.rotary = RotaryTable(rope_inv_freq(spec).float())
        attention = kernel.description if kernel else "ORT GroupQueryAttention"
        self.description = (
            f"onnxruntime cpu (W8A8 integer layer graphs, rows of all sequences batched, {head}, attention: {attention}), "
            f"{self.threads} threads"
        )

    def head(self, hidden: np.ndarray) -> torch.Tensor:
        if self.int8_head is not None:
            return torch.from_numpy(self.int8_head.run([onnx_layers.Y], {onnx_layers.X: hidden})[0])
        return self.float_head(torch.from_numpy(hidden)).float()


class LayeredOnnxLM:
    """One sequence over a ``LayeredModel``: its keys and values, one buffer pair per layer, grown by doubling."""

    def __init__(self, model: LayeredModel, max_length: int | None = None):
        self.model = model
        self.spec = model.spec
        self.vocab_size = model.spec.vocab_size
        self.max_length = max_length or model.spec.max_position_embeddings
        self.description = model.description
        self._length = self._capacity = 0
        # per layer (keys, values): numpy arrays in the C kernel's layout, else OrtValues for GroupQueryAttention
        self._cache: list[tuple] = []
        self._bindings: list = []  # per layer: the attention call's binding (``_bind``)
        # the attention call's seqlens_k and total_sequence_length, set in place before each call
        self._seqlen, self._total = np.zeros(1, np.int32), np.zeros((), np.int32)

    # --- CausalLM ---
    def prefill(self, ids: Sequence[int]) -> torch.Tensor:
        """The prompt in pieces of ``prefill_chunk`` tokens, one forward each, as a server's rounds run it."""
        if len(ids) == 0:
            raise ValueError("no tokens to run")
        self.truncate(0)
        chunk = self.prefill_chunk
        for start in range(0, len(ids), chunk):
            logits = self._forward([self], [ids[start : start + chunk]], last_only=[True])
        return logits[0]

    def verify(self, ids: Sequence[int]) -> torch.Tensor:
        return self._forward([self], [ids])

    def verify_skipping(self, ids: Sequence[int], skip_layers: frozenset[int]) -> torch.Tensor:
        return self._forward([self], [ids], skip_layers=skip_layers)

    def verify_batch(
        self, sequences: Sequence[LayeredOnnxLM], blocks: Sequence[Sequence[int]], prefills: Sequence[bool] = ()
    ) -> list[torch.Tensor]:
        if any(sequence.model is not self.model for sequence in sequences):
            raise ValueError("verify_batch takes sequences opened over this model's weights (new_sequence)")
        prefills = list(prefills) or [False] * len(blocks)
        chunk = self.prefill_chunk
        for sequence, block, prefill in zip(sequences, blocks, prefills):
            if prefill and (len(block) > chunk or sequence.length % chunk):
                raise ValueError(f"a prefill block is a piece of its prompt: at most {chunk} tokens, at a multiple of {chunk}")
        logits = self._forward(sequences, blocks, last_only=prefills)
        return split_batch(logits, blocks, prefills)

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self._length:
            raise ValueError(f"cannot truncate a cache of length {self._length} to {length}")
        self._length = length

    def new_sequence(self) -> LayeredOnnxLM:
        return type(self)(self.model, self.max_length)

    @property
    def prefill_chunk(self) -> int:
        return self.model.prefill_chunk

    @property
    def length(self) -> int:
        return self._length

    @property
    def num_layers(self) -> int:
        return self.spec.num_layers

    @property
    def device(self) -> str:
        return "cpu"

    def kv_cache_bytes(self, tokens: int) -> int:
        """The most a sequence's float32 buffers hold at ``tokens`` positions (capacity doubling, old beside new)."""
        return 2 * kv_cache_bytes(self.spec, max(KEY_CHUNK, 2 * round_up(tokens, KEY_CHUNK)), 4)

    # --- the step ---
    def _reserve(self, extra: int) -> None:
        end = self._length + extra
        if end > self.max_length:
            raise QuasarError(f"sequence of {end} tokens exceeds the context window ({self.max_length})")
        kernel = self.model.kernel is not None
        end += extra == 1 and not kernel  # the copy a one-row block is sent with to GroupQueryAttention (``_attend``)
        if end <= self._capacity:
            return
        capacity = max(2 * self._capacity, round_up(end, KEY_CHUNK))
        if kernel:
            spec = self.spec
            grown = decoder_ops.new_caches(spec.num_layers, spec.num_kv_heads, capacity, spec.head_dim)
            for old, new in zip(self._cache, grown):
                decoder_ops.copy_cache(old, new, self._length)
            self._cache, self._capacity = grown, capacity
            return

        shape = (1, self.spec.num_kv_heads, capacity, self.spec.head_dim)
        buffers = [(np.zeros(shape, np.float32), np.zeros(shape, np.float32)) for _ in range(self.spec.num_layers)]
        for old, new in zip(self._cache if self._length else [], buffers):
            for source, target in zip(old, new):
                target[:, :, : self._length] = source.numpy()[:, :, : self._length]
        grown = [tuple(OrtValue.ortvalue_from_numpy(buffer) for buffer in pair) for pair in buffers]
        self._cache, self._capacity = grown, capacity
        self._bindings = [self._bind(keys, values) for keys, values in grown]

    def _bind(self, keys, values):
        """One layer's attention binding, its cache buffers and lengths bound once: a call binds only its rows and output."""
        binding = self.model.attention.io_binding()
        binding.bind_ortvalue_input(onnx_layers.SEQLEN, OrtValue.ortvalue_from_numpy(self._seqlen))
        binding.bind_ortvalue_input(onnx_layers.TOTAL, OrtValue.ortvalue_from_numpy(self._total))
        binding.bind_ortvalue_input(onnx_layers.CACHE_KEY, keys)
        binding.bind_ortvalue_input(onnx_layers.CACHE_VALUE, values)
        binding.bind_output(onnx_layers.Y, "cpu")  # first: ``get_outputs`` lists them in binding order
        binding.bind_ortvalue_output(f"{onnx_layers.CACHE_KEY}_out", keys)
        binding.bind_ortvalue_output(f"{onnx_layers.CACHE_VALUE}_out", values)
        return binding

    def _attend(self, layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        """This sequence's attention at ``layer`` for its n new rows, one row sent as two (``GroupQueryAttention`` rounds a
        single row otherwise, and a decode must match its row in a verify block: tests/test_onnx_layered.py)."""
        n = q.shape[0]
        if n == 1:
            q, k, v = (np.concatenate([rows, rows]) for rows in (q, k, v))
        total = self._length + q.shape[0]
        binding = self._bindings[layer]
        for name, rows in ((onnx_layers.Q, q), (onnx_layers.K, k), (onnx_layers.V, v)):
            binding.bind_cpu_input(name, rows[None])
        binding.bind_output(onnx_layers.Y, "cpu")  # again: a run leaves its output bound, shaped for its own rows
        self._seqlen[0], self._total[()] = total - 1, total
        self.model.attention.run_with_iobinding(binding)
        return binding.get_outputs()[0].numpy().reshape(q.shape[0], -1)[:n]

    def _forward(
        self,
        sequences: Sequence[LayeredOnnxLM],
        blocks: Sequence[Sequence[int]],
        last_only: Sequence[bool] = (),
        skip_layers: frozenset[int] = frozenset(),
    ) -> torch.Tensor:
        """Appends ``blocks[i]`` to ``sequences[i]`` for every i in one pass; their logits stacked, as ``forward_blocks``."""
        model = self.model
        sizes = [len(block) for block in blocks]
        if not all(sizes):
            raise ValueError("no tokens to run")
        for sequence, n in zip(sequences, sizes):
            sequence._reserve(n)
        positions = np.concatenate([np.arange(s.length, s.length + n) for s, n in zip(sequences, sizes)])
        cos, sin = model.rotary.rows(positions)
        ids = torch.as_tensor([token for block in blocks for token in block], dtype=torch.long)
        x = model.table[ids].float().numpy()
        ends = np.cumsum(sizes).tolist()
        step = None
        if model.kernel is not None:
            spec = self.spec
            step = decoder_ops.StepAttention(
                model.kernel, model.pool, model.threads, spec.num_heads, spec.num_kv_heads, spec.head_dim,
                [sequence._cache for sequence in sequences], [sequence.length for sequence in sequences], sizes,
            )  # fmt: skip
        for i in range(self.spec.num_layers):
            if i in skip_layers:
                continue
            q, k, v = model.inputs[i].run(None, {onnx_layers.X: x, onnx_layers.COS: cos, onnx_layers.SIN: sin})
            if step is not None:
                context = step(i, q, k, v)
            else:
                context = np.empty((len(x), q.shape[1]), np.float32)
                for sequence, n, end in zip(sequences, sizes, ends):
                    rows = slice(end - n, end)
                    context[rows] = sequence._attend(i, q[rows], k[rows], v[rows])
            x = model.outputs[i].run(None, {onnx_layers.X: x, onnx_layers.CTX: context})[0]
        for sequence, n in zip(sequences, sizes):
            sequence._length += n
        if any(last_only):
            x = x[[r for end, n, last in zip(ends, sizes, last_only) for r in ([end - 1] if last else range(end - n, end))]]
        hidden = model.final_norm.run(None, {onnx_layers.X: np.ascontiguousarray(x)})[0]
        return model.head(hidden)


def load_layered(files: ModelFiles, threads: int | None = None, progress: bool = True, attention: str = "auto") -> LayeredOnnxLM:
    """A W8A8 artifact on ONNX Runtime as batched layer graphs; refused in one line where ``unsupported(files)`` says why."""
    reason = unsupported(files)
    if reason is not None:
        raise QuasarError(
            f"{files.path}: layer skipping and batched serving on ONNX Runtime need a W8A8 artifact whose layers are all int8; "
            f"this one is {reason}"
        )
    return LayeredOnnxLM(LayeredModel(files, threads, progress, attention))
