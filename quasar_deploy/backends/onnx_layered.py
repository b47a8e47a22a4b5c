"""ONNX Runtime on the CPU, batched: a W8A8 artifact as per-layer graphs over stacked rows (``exporters/onnx_layers``).

What the whole-graph export (``backends/onnxruntime``) cannot do, this does:

- **Several sequences in one step.** Every sequence's rows (verify blocks and prompts alike) go through each layer's
  row graphs together, reading the weights once; each sequence then attends over its own cache in its own call. A row's
  values do not depend on its neighbours (see the exporter's docstring), so a request's output is the same alone and in
  a batch: this is a ``BatchVerifyingLM``, and ``serve`` batches on it.
- **Layers skipped** (``verify_skipping``, the layerskip drafter): a skipped layer's graphs are simply not run.
- **Rollback without copies.** Each sequence's keys and values live in preallocated buffers that attention writes in
  place; truncating moves a length (the whole graph slices its cache values instead).

Attention runs in ``cpu_attention``'s C kernel where this CPU runs it (every sequence of a step in one call per layer),
else in ORT's ``GroupQueryAttention``, one call per sequence and layer. Both keep a row's result independent of its
company; they round differently from each other, so a process uses one of them throughout.

The graphs are built from the artifact at load, a layer at a time, in memory: nothing is exported to disk. The float
lm_head runs beside them on torch, as ``load_head`` does for an export (bf16 where the CPU computes it); an int8 head
(``--int8-lm-head``) is a graph of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
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
    """Why ``files`` cannot run as layer graphs (None: it can): every layer linear must be W8A8 (a float product's rounding
    may depend on how many rows it has), and attention must be plain causal (no sliding window)."""
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
    """What every sequence shares: the sessions (two per layer, attention, final norm, an int8 head), the embedding table,
    the float head and the rotary table."""

    def __init__(self, files: ModelFiles, threads: int | None = None, progress: bool = True, attention: str = "auto"):
        """``attention``: "auto" (the C kernel where it runs, else ORT's) or "ort" (ORT's ``GroupQueryAttention``, as
        ``bench batched-step``'s contender ``onnxruntime-gqa`` times it)."""
        import onnxruntime as ort

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
        kernel = decoder_ops.load(spec.head_dim) if attention == "auto" else None
        # attention: the C kernel (threads share a step's sequences and heads), else ORT's GroupQueryAttention per sequence
        self.kernel = kernel
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
        self._length = 0
        self._capacity = 0
        # per layer (keys, values): numpy arrays in the C kernel's layout (``decoder_ops.new_caches``), else OrtValues
        # [1, kv_heads, capacity, head_dim] for GroupQueryAttention
        self._cache: list[tuple] = []
        self._bindings: list = []  # per layer: the attention call's binding, its cache and lengths bound once (``_bind``)
        # the attention call's seqlens_k and total_sequence_length, set in place before each call: OrtValues over them
        # are bound once per layer
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
        """The most a sequence's buffers hold at ``tokens`` positions: float32, capacity doubling from ``KEY_CHUNK``, and
        the old buffers beside the new ones while they are copied."""
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
        from onnxruntime import OrtValue

        shape = (1, self.spec.num_kv_heads, capacity, self.spec.head_dim)
        grown = []
        for i in range(self.spec.num_layers):
            pair = []
            for j in range(2):
                buffer = np.zeros(shape, np.float32)
                if self._length:
                    buffer[:, :, : self._length] = self._cache[i][j].numpy()[:, :, : self._length]
                pair.append(OrtValue.ortvalue_from_numpy(buffer))
            grown.append(tuple(pair))
        self._cache, self._capacity = grown, capacity
        self._bindings = [self._bind(keys, values) for keys, values in grown]

    def _bind(self, keys, values):
        """One layer's attention binding with what stays from call to call bound once: the cache buffers (in and out: the
        same buffers, written in place) and the lengths (``_seqlen``, ``_total``, set per call). A call then binds only
        its rows and its output, which saves most of a call's Python-side cost (per sequence and layer, a step's
        largest)."""
        from onnxruntime import OrtValue

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
        """This sequence's attention at ``layer`` for its n new rows (written to its cache at ``length .. length + n``).

        One row goes as two (the second a copy, its keys and values written past the end, where nothing reads them):
        ``GroupQueryAttention`` takes another path for one query row, with other rounding, while a row's result is the
        same bits for any other number of rows (found by test on this CPU, tests/test_onnx_layered.py). So a row's
        logits do not depend on its block's size: a one-token decode and the same row in a verify block agree, which
        is what makes speculative greedy output the verifier's own greedy decode here."""
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
        """Appends ``blocks[i]`` to ``sequences[i]`` for every i in one pass; their logits stacked, as
        ``Decoder.forward_blocks`` (only the last row of a block whose ``last_only[i]``)."""
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
