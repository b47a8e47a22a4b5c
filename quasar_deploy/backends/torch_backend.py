"""The PyTorch backend: our decoder with a pluggable linear kernel (cpu here; cuda, npu elsewhere)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..artifact import ModelFiles
from ..cpu import decoder_ops
from ..cpu.choice import default_int8_kernel
from ..cpu.linears import default_float_dtype, default_float_kernel, dtype_name, int8_kernel_label
from ..cpu.machine import default_threads
from ..errors import QuasarError
from ..memory import kv_cache_bytes
from ..model import KEY_CHUNK, Decoder, KVCache, held_text, round_up
from ..speculative.causal_lm import split_batch


def unavailable() -> None:
    """The cpu backend runs wherever torch does."""
    return None


class TorchCausalLM:
    """Serves ``LayerSkippingLM`` from a ``Decoder``: ``verify_skipping`` lets a self-speculative drafter run a shallower copy."""

    def __init__(self, decoder: Decoder, max_length: int | None = None, description: str = ""):
        self.decoder = decoder
        self.spec = decoder.spec
        self.vocab_size = decoder.spec.vocab_size
        self.max_length = max_length or decoder.spec.max_position_embeddings
        self.description = description
        self._device = decoder.inv_freq.device
        self.cache = self._new_cache()

    def _new_cache(self) -> KVCache:
        return self.decoder.new_cache()

    def _ids(self, ids: Sequence[int]) -> torch.Tensor:
        if len(ids) == 0:
            raise ValueError("no tokens to run")
        if self.cache.length + len(ids) > self.max_length:
            raise QuasarError(f"sequence of {self.cache.length + len(ids)} tokens exceeds the context window ({self.max_length})")
        return torch.as_tensor(list(ids), dtype=torch.long, device=self._device)

    @property
    def prefill_chunk(self) -> int | None:
        """Prompt pieces of this many tokens where the C attention kernel attends; None: a prompt prefills whole."""
        kernel = self.decoder.attention_kernel
        return None if kernel is None else kernel.prefill_chunk

    def prefill(self, ids: Sequence[int]) -> torch.Tensor:
        """The prompt in one forward, or in pieces of ``prefill_chunk`` tokens, as a server's rounds run it."""
        if len(ids) == 0:
            raise ValueError("no tokens to run")
        self.cache.truncate(0)
        chunk = self.prefill_chunk or len(ids)
        for start in range(0, len(ids), chunk):
            logits = self.decoder.forward_blocks([self._ids(ids[start : start + chunk])], [self.cache], last_only=[True])[0]
        return logits

    def verify(self, ids: Sequence[int]) -> torch.Tensor:
        return self.decoder(self._ids(ids), self.cache)

    def verify_skipping(self, ids: Sequence[int], skip_layers: frozenset[int]) -> torch.Tensor:
        return self.decoder(self._ids(ids), self.cache, skip_layers)

    def truncate(self, length: int) -> None:
        self.cache.truncate(length)

    def new_sequence(self) -> TorchCausalLM:
        """The same decoder (weights, packed kernels) with a fresh KV cache: one per concurrent request."""
        return type(self)(self.decoder, self.max_length, self.description)

    @property
    def length(self) -> int:
        return self.cache.length

    @property
    def num_layers(self) -> int:
        return self.spec.num_layers

    @property
    def device(self) -> torch.device:
        """Where the weights and KV caches live."""
        return self._device

    def kv_cache_bytes(self, tokens: int) -> int:
        """The most a sequence's KV cache holds at ``tokens`` positions (capacity doubles from ``KEY_CHUNK``)."""
        kernel = self.decoder.attention_kernel
        itemsize = kernel.itemsize if kernel is not None else self.decoder.dtype.itemsize
        return kv_cache_bytes(self.spec, max(KEY_CHUNK, 2 * round_up(tokens, KEY_CHUNK)), itemsize)


class BatchingTorchCausalLM(TorchCausalLM):
    """A row-invariant ``TorchCausalLM``, so also a ``BatchVerifyingLM``: many sequences' blocks in one pass."""

    def verify_batch(
        self, sequences: Sequence[TorchCausalLM], blocks: Sequence[Sequence[int]], prefills: Sequence[bool] = ()
    ) -> list[torch.Tensor]:
        if any(sequence.decoder is not self.decoder for sequence in sequences):
            raise ValueError("verify_batch takes sequences opened over this model's weights (new_sequence)")
        prefills = list(prefills) or [False] * len(blocks)
        chunk = self.prefill_chunk
        for sequence, block, prefill in zip(sequences, blocks, prefills):
            if prefill and chunk is None:
                sequence.cache.truncate(0)
            elif prefill and (len(block) > chunk or sequence.length % chunk):
                raise ValueError(f"a prefill block is a piece of its prompt: at most {chunk} tokens, at a multiple of {chunk}")
        ids = [sequence._ids(block) for sequence, block in zip(sequences, blocks)]
        logits = self.decoder.forward_blocks(ids, [sequence.cache for sequence in sequences], last_only=prefills)
        return split_batch(logits, blocks, prefills)


def load_cpu(
    files: ModelFiles,
    float_kernel: str | None = None,
    int8_kernel: str | None = None,
    threads: int | None = None,
    float_dtype: str | None = None,
    attention: str = "auto",
) -> TorchCausalLM:
    """W8A8 artifact or float checkpoint on the CPU, with the fastest bit-exact kernels this CPU has. ``float_dtype`` (default
    ``default_float_dtype``): a float checkpoint runs wholly in it; a W8A8 artifact's float lm_head computes in it."""
    dtype = default_float_dtype("cpu", float_dtype)
    decoder = files.decoder(torch.float32, head_dtype=dtype) if files.is_artifact else files.decoder(dtype)
    return cpu_causal_lm(decoder, float_kernel, int8_kernel, threads, "W8A8" if files.is_artifact else "float", attention)


ATTENTIONS = ("auto", "torch")


def cpu_causal_lm(
    decoder: Decoder,
    float_kernel: str | None = None,
    int8_kernel: str | None = None,
    threads: int | None = None,
    kind: str = "",
    attention: str = "auto",
) -> TorchCausalLM:
    """``decoder`` with the cpu kernels bound; a ``BatchingTorchCausalLM`` under the oneDNN float kernel (row-invariant)."""
    # torch sizes its pool from the host's cores; never let it exceed what this process may use (affinity, cgroup quota)
    torch.set_num_threads(threads or min(torch.get_num_threads(), default_threads()))
    float_kernel = float_kernel or default_float_kernel("cpu")
    int8_kernel = int8_kernel or default_int8_kernel("cpu")
    decoder.prepare(float_kernel, int8_kernel, fuse=True)
    bind_cpu_attention(decoder, attention)
    attends = decoder.attention_kernel.description if decoder.attention_kernel else "torch ops"
    lm_class = BatchingTorchCausalLM if float_kernel == "onednn" else TorchCausalLM
    return lm_class(
        decoder,
        description=f"cpu {kind}, {torch.get_num_threads()} threads "
        f"(float dtype {dtype_name(decoder.lm_head.dtype)}{held_text(decoder.lm_head)}, float kernel {float_kernel}, "
        f"int8 kernel {int8_kernel_label(int8_kernel)}, attention {attends})",
    )


def bind_cpu_attention(decoder: Decoder, attention: str = "auto") -> None:
    """Attend, and run the norms and SiLU gates, on ``decoder_ops``' C kernel where it runs for this model's heads and the
    attention is plain causal ("auto"; torch's ops elsewhere or with "torch"). Before any cache is made."""
    if attention not in ATTENTIONS:
        raise QuasarError(f"attention is one of {', '.join(ATTENTIONS)}, not {attention!r}")
    spec = decoder.spec
    kernel = decoder_ops.load(spec.head_dim) if attention == "auto" and spec.sliding_window is None else None
    if kernel is None:
        decoder.attention_kernel = decoder.row_kernel = None
        return
    threads = torch.get_num_threads()
    attentions = [layer.self_attn for layer in decoder.model.layers]
    norms = [(a.q_norm.weight, a.k_norm.weight) if spec.qk_norm else (None, None) for a in attentions]
    decoder.attention_kernel = decoder_ops.TorchAttention(kernel, spec, threads, norms)
    decoder.row_kernel = decoder_ops.TorchRows(kernel, threads)
