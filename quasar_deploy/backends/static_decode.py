"""The decoder's forward over fixed KV buffers with positions as device data: what a CUDA graph can capture and replay.

The cache's buffers grow only between steps (``StaticCache.make_room``), positions are ``start + arange(t)`` with
``start`` a device tensor, and attention reads the first ``span`` cached positions (a multiple of ``SPAN``), masked per
row. Blocks of up to ``BLOCK_ROWS`` tokens run as exactly ``BLOCK_ROWS`` rows (padded with token 0, their cache writes
past the sequence): a row's bits are the same in a verify block as in a decode, and one graph per span serves all.
"""

from __future__ import annotations

import torch

from ..decoder_spec import DecoderSpec
from ..model import Decoder, KVCache, rotary_at, round_up, visible

SPAN = 256  # keys attended are rounded up to this many positions: one graph per span, little attention wasted
BLOCK_ROWS = 16  # decode and verify blocks up to this long run as this many rows (k < 16)


class StaticCache(KVCache):
    """A ``KVCache`` whose buffers move only in ``make_room`` (between steps), in ``SPAN`` blocks up to the window."""

    def __init__(self, spec: DecoderSpec, dtype: torch.dtype, device: torch.device | str, max_length: int):
        self.max_length = max_length
        super().__init__(spec, dtype, device, min(SPAN, max_length + BLOCK_ROWS))

    def span(self, end: int) -> int:
        """Cached positions a block ending at ``end`` attends over (masked beyond each row's own position)."""
        return min(round_up(end, SPAN), self.max_length)

    def make_room(self, end: int) -> bool:
        """Room for positions up to ``end``; True when the buffers moved (graphs captured on them are stale)."""
        if end <= self.capacity:
            return False
        self._grow(min(max(2 * self.capacity, round_up(end, SPAN)), self.max_length + BLOCK_ROWS))
        return True


@torch.inference_mode()
def static_forward(
    decoder: Decoder, cache: StaticCache, ids: torch.Tensor, start: torch.Tensor, span: int, skip_layers: frozenset[int] = frozenset()
) -> torch.Tensor:
    """Logits [t, vocab] (float32) of ``ids`` at positions ``start`` (a one-element device tensor) onwards; writes their
    keys/values. The caller reserves the room and moves ``cache.length`` afterwards (a replayed graph cannot)."""
    positions = start + torch.arange(ids.shape[0], device=ids.device)
    cos, sin = rotary_at(decoder.inv_freq, positions, decoder.dtype)
    mask = visible(decoder.spec, positions, span)
    x = decoder.embed(ids)
    for i, layer in enumerate(decoder.model.layers):
        if i in skip_layers:
            continue
        attention = layer.self_attn
        q, k, v = attention.rotated_qkv(layer.input_layernorm(x), cos, sin)
        cache.keys[i].index_copy_(1, positions, k)
        cache.values[i].index_copy_(1, positions, v)
        attended = attention.attend(q, cache.keys[i][:, :span], cache.values[i][:, :span], mask)
        x = x + attention.output(attended)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return decoder.lm_head(decoder.model.norm(x)).float()


class GraphedSteps:
    """CUDA graphs of ``static_forward`` for one sequence, one per (rows, span), captured on first use."""

    def __init__(self, decoder: Decoder, cache: StaticCache):
        self.decoder, self.cache = decoder, cache
        self.device = decoder.inv_freq.device
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def clear(self) -> None:
        self.graphs.clear()

    def run(self, ids: torch.Tensor, start: int, span: int) -> torch.Tensor:
        key = (ids.shape[0], span)
        if key not in self.graphs:
            self.graphs[key] = self._capture(ids, start, span)
        static_ids, static_start, graph, logits = self.graphs[key]
        static_ids.copy_(ids)
        static_start.fill_(start)
        graph.replay()
        return logits.clone()  # the next replay of any graph in this pool may reuse the output's memory

    def _capture(self, ids: torch.Tensor, start: int, span: int):
        static_ids = ids.clone()
        static_start = torch.full((1,), start, dtype=torch.long, device=self.device)

        def step() -> torch.Tensor:
            return static_forward(self.decoder, self.cache, static_ids, static_start, span)

        # warm up outside the capture with the real inputs (its cache writes are the replay's)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = step()
        return static_ids, static_start, graph, logits
