"""What the speculative loop needs from a verifier (and a draft model): the ``CausalLM`` protocol.

The protocol belongs to the loop, not to the backends: backends implement it, the
loop and the drafters only ever see it. A backend owns one sequence's KV cache; the
loop only prefills, appends a block of tokens (one for plain decoding, k+1 to verify
a draft) and rolls the cache back after a rejection.
"""

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
    """A verifier that can open more sequences over the same weights: what serving several requests at once needs.

    Its own protocol, not part of ``CausalLM``, so that a backend that cannot share its
    weights (or a wrapper such as a pruned model) still serves one sequence at a time.
    """

    def new_sequence(self) -> ForkingLM:
        """Another ``CausalLM`` over the same weights (decoder, session) with its own empty cache; cheap, no weights copied."""


@runtime_checkable
class LayerSkippingLM(CausalLM, Protocol):
    """A verifier that can also run with some decoder layers switched off (self-speculative drafting).

    A method of its own, not an optional argument of ``verify``, so that ``isinstance``
    tells a backend that can skip from one that merely has layers (a whole exported graph).
    """

    @property
    def num_layers(self) -> int:
        """Decoder layers, numbered 0..num_layers-1."""

    def verify_skipping(self, ids: Sequence[int], skip_layers: frozenset[int]) -> torch.Tensor:
        """``verify`` without the layers in ``skip_layers``; their cache slots at these positions are left stale."""


@runtime_checkable
class BatchVerifyingLM(ForkingLM, Protocol):
    """A verifier whose sequences can run their blocks together in one forward: what a batched serving step needs.

    Each block's logits must equal, bit for bit, what ``verify`` (or ``prefill``) on that
    sequence alone gives (row-invariant kernels), so a request's output does not depend on
    its neighbours. Backends that cannot promise that (or cannot stack rows) leave this out
    and are served round-robin, one ``prefill`` or ``verify`` per sequence.
    """

    prefill_chunk: int | None
    """None: a prompt is prefilled whole. Else its pieces of this many tokens, at fixed offsets (0, chunk, 2 chunk, ...),
    are prefilled one forward each, alone (``prefill``) and batched alike: a server can then spread a long prompt over
    rounds, each within its prompt-token budget, while the other sequences keep stepping."""

    def verify_batch(
        self, sequences: Sequence[BatchVerifyingLM], blocks: Sequence[Sequence[int]], prefills: Sequence[bool] = ()
    ) -> list[torch.Tensor]:
        """For every i, in one forward, on ``sequences[i]`` (opened from this one's weights): ``prefill(blocks[i])`` (its
        logits [vocab]) where ``prefills[i]``, else ``verify(blocks[i])`` ([len, vocab]). With a ``prefill_chunk``, a
        prefill block is the next piece of its prompt (appended; a fresh sequence starts empty), and its logits are its
        last row's."""


# prompts prefill in pieces of this many tokens on a backend whose attention gives a row the same bits in any block (the
# layer graphs; the cpu backend on the C attention kernel), alone and in a server's rounds alike: the server's
# prompt-token budget per round (``scheduler.PREFILL_TOKENS``) holds one piece
PREFILL_CHUNK = 256


def split_batch(logits: torch.Tensor, blocks: Sequence[Sequence[int]], prefills: Sequence[bool]) -> list[torch.Tensor]:
    """A batched forward's stacked logits back per sequence, as ``verify_batch`` returns them: a prefill's one row
    ([vocab]), a verify block's rows ([len, vocab])."""
    parts = logits.split([1 if prefill else len(block) for block, prefill in zip(blocks, prefills)])
    return [part[0] if prefill else part for part, prefill in zip(parts, prefills)]
