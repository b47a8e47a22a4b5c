"""The drafter protocol: anything that guesses the next tokens cheaply.

One per generation; the loop only appends to ``tokens`` between proposals, so a drafter may keep incremental state."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from .acceptance import Sampler

if TYPE_CHECKING:
    from pathlib import Path

    from .causal_lm import CausalLM
    from .output_cache import OutputCache


class DrafterContext(Protocol):
    """What a drafter factory may use besides its options: the verifier and the engine's cached setup work."""

    lm: CausalLM
    output_cache: OutputCache | None  # earlier generations' outputs, where the engine keeps them (opt-in)

    def choose_skip_layers(self, fraction: float) -> frozenset[int]:
        """The verifier's layers to skip for a layer-skipping draft of ``fraction`` of them (measured once, remembered)."""

    def draft_lm(self, path: str | Path) -> CausalLM:
        """The draft model at ``path``, loaded once, its tokenizer checked against the verifier's."""


@dataclass(frozen=True)
class Draft:
    """Proposed tokens and, for drafters that sample, the distribution each was drawn from ([len(tokens), vocab])."""

    tokens: list[int]
    probs: torch.Tensor | None = None


NO_DRAFT = Draft([])


class Drafter(Protocol):
    def propose(self, tokens: Sequence[int], k: int, sampler: Sampler) -> Draft:
        """Up to ``k`` tokens likely to follow ``tokens``."""


@runtime_checkable
class RewindableDrafter(Drafter, Protocol):
    """A drafter that can also take back tokens it was shown: the cascade shows it drafts the float model may reject."""

    def rewind(self, length: int) -> None:
        """The first ``length`` tokens of what ``propose`` was shown are final (``length`` never decreases)."""


class NoDrafter:
    """Plain autoregressive decoding on the verifier: the baseline every drafter is measured against."""

    def propose(self, tokens: Sequence[int], k: int, sampler: Sampler) -> Draft:
        return NO_DRAFT

    def rewind(self, length: int) -> None:
        """Nothing to take back: it keeps no state."""


def no_drafter(context: DrafterContext, options: Mapping[str, Any]) -> NoDrafter:
    """The registry's factory for "none": plain decoding reads neither the verifier nor any option."""
    return NoDrafter()


def draft_autoregressive(logits: torch.Tensor, step: Callable[[int], torch.Tensor], k: int, sampler: Sampler) -> Draft:
    """k tokens from a language model: ``logits`` predict the first, ``step(token)`` feeds a token and predicts the next."""
    tokens: list[int] = []
    dists: list[torch.Tensor] = []
    for i in range(k):
        if i:
            logits = step(tokens[-1])
        token, dist = sampler.draw(logits)
        tokens.append(token)
        if dist is not None:
            dists.append(dist)
    return Draft(tokens, torch.stack(dists) if dists else None)
