"""Classic speculative decoding: a separate small model with the same tokenizer drafts for the verifier."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..errors import QuasarError
from .acceptance import Sampler
from .causal_lm import CausalLM
from .drafters import NO_DRAFT, Draft, draft_autoregressive

if TYPE_CHECKING:
    from .drafters import DrafterContext


def check_same_vocabulary(verifier_vocab: dict[str, int], draft_vocab: dict[str, int], draft_name: str) -> None:
    """Speculation compares token ids, so the two tokenizers must map every token to the same id."""
    if verifier_vocab == draft_vocab:
        return
    differ = sorted(set(verifier_vocab.items()) ^ set(draft_vocab.items()))
    raise QuasarError(
        f"draft model {draft_name}: its tokenizer differs from the verifier's ({len(verifier_vocab)} vs {len(draft_vocab)} tokens, "
        f"first difference {differ[0][0]!r}); a draft model must share the verifier's tokenizer"
    )


class ModelDrafter:
    """Drafts with its own model and cache; its logits are cut or padded to the verifier's ``vocab_size``."""

    def __init__(self, lm: CausalLM, vocab_size: int):
        self.lm, self.vocab_size = lm, vocab_size
        self._cached: list[int] = []  # the tokens whose keys and values the draft cache holds
        self._agreed = 0  # a prefix of _cached known to equal the sequence (everything passed to the last propose)

    def _fit(self, logits: torch.Tensor) -> torch.Tensor:
        if logits.shape[-1] >= self.vocab_size:
            return logits[: self.vocab_size]
        return torch.cat([logits, logits.new_full((self.vocab_size - logits.shape[-1],), -torch.inf)])

    def _step(self, token: int) -> torch.Tensor:
        self._cached.append(token)
        return self._fit(self.lm.verify([token])[-1])

    def rewind(self, length: int) -> None:
        """Tokens past ``length`` may be replaced: compare them again at the next proposal (the cache rolls back there)."""
        self._agreed = min(self._agreed, length)

    def propose(self, tokens: Sequence[int], k: int, sampler: Sampler) -> Draft:
        k = min(k, self.lm.max_length - len(tokens) + 1)
        if k <= 0:
            return NO_DRAFT
        keep = self._agreed
        limit = min(len(self._cached), len(tokens) - 1)
        while keep < limit and self._cached[keep] == tokens[keep]:
            keep += 1
        del self._cached[keep:]
        self._cached.extend(tokens[keep:])
        if keep == 0:
            logits = self.lm.prefill(tokens)
        else:
            self.lm.truncate(keep)
            logits = self.lm.verify(tokens[keep:])[-1]
        self._agreed = len(tokens)
        return draft_autoregressive(self._fit(logits), self._step, k, sampler)


def model_drafter(context: DrafterContext, options: Mapping[str, Any]) -> ModelDrafter:
    """The registry's factory for "model": the draft model comes through the context, which loads each path once."""
    if options["draft_model"] is None:
        raise QuasarError("draft='model' needs draft_model, the path of a small model with the same tokenizer")
    return ModelDrafter(context.draft_lm(options["draft_model"]), context.lm.vocab_size)
