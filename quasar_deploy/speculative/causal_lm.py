"""What the speculative loop needs from a verifier (and a draft model): the ``CausalLM`` protocol."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch


@runtime_checkable
class CausalLM(Protocol):
    vocab_size: int
    max_length: int

    def prefill(self, ids: Sequence[int]) -> torch.Tensor:
        """Start a new sequence: cache ``ids`` and return the logits [vocab] of the last position."""

    def verify(self, ids: Sequence[int]) -> torch.Tensor:
        """Append ``ids`` to the cache and return their logits [len(ids), vocab] (float32)."""

    def truncate(self, length: int) -> None:
        """Roll the cache back to its first ``length`` positions."""

    @property
    def length(self) -> int:
        """Positions currently cached."""


@runtime_checkable
class ForkingLM(CausalLM, Protocol):
    """A verifier that can open more sequences over the same weights: what serving several requests at once needs."""

    def new_sequence(self) -> ForkingLM:
        """Another ``CausalLM`` over the same weights (decoder, session) with its own empty cache; cheap, no weights copied."""


@runtime_checkable
class LayerSkippingLM(CausalLM, Protocol):
    """A verifier that can also run with some decoder layers switched off (self-speculative drafting)."""

    @property
    def num_layers(self) -> int:
        """Decoder layers, numbered 0..num_layers-1."""

    def verify_skipping(self, ids: Sequence[int], skip_layers: frozenset[int]) -> torch.Tensor:
        """``verify`` without the layers in ``skip_layers``; their cache slots at these positions are left stale."""


@runtime_checkable
class BatchVerifyingLM(ForkingLM, Protocol):
    """A verifier whose sequences can run their blocks together in one forward: what a batched serving step needs.
    Each block's logits must be bit-exact with ``verify`` (or ``prefill``) on that sequence alone."""

    prefill_chunk: int | None
    """None: a prompt is prefilled whole. Else in pieces of this many tokens at fixed offsets, one forward each, alone
    and batched alike, so a server can spread a long prompt over rounds."""

    def verify_batch(
        self, sequences: Sequence[BatchVerifyingLM], blocks: Sequence[Sequence[int]], prefills: Sequence[bool] = ()
    ) -> list[torch.Tensor]:
        """In one forward, ``prefill(blocks[i])`` where ``prefills[i]``, else ``verify(blocks[i])``, on ``sequences[i]``."""


PREFILL_CHUNK = 256  # the prefill pieces of a backend whose attention gives a row the same bits in any block


def split_batch(logits: torch.Tensor, blocks: Sequence[Sequence[int]], prefills: Sequence[bool]) -> list[torch.Tensor]:
    """A batched forward's stacked logits back per sequence, as ``verify_batch`` returns them."""
    parts = logits.split([1 if prefill else len(block) for block, prefill in zip(blocks, prefills)])
    return [part[0] if prefill else part for part, prefill in zip(parts, prefills)]
