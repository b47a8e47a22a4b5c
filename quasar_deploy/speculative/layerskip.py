"""Self-speculative drafting: the verifier itself, with some decoder layers skipped, drafts for the full model.

The draft reads the full model's cache for the accepted prefix; every slot it wrote is rolled back before the verify."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..errors import QuasarError
from .acceptance import Sampler
from .causal_lm import CausalLM, LayerSkippingLM
from .drafters import Draft, draft_autoregressive

if TYPE_CHECKING:
    from .drafters import DrafterContext

DEFAULT_SKIP_FRACTION = 0.5


def check_can_skip(lm: CausalLM) -> LayerSkippingLM:
    """``lm`` itself once it is known to skip layers; a one-line error for a backend that cannot (e.g. a whole exported graph)."""
    if not isinstance(lm, LayerSkippingLM):
        raise QuasarError(
            f"backend {getattr(lm, 'description', type(lm).__name__)!r} cannot skip layers: use another drafter, or a backend "
            "that runs the torch decoder (load(path, needs=('layer_skip',)) or backend='cpu')"
        )
    return lm


def check_skip_layers(lm: CausalLM, layers: Iterable[int]) -> frozenset[int]:
    num_layers = check_can_skip(lm).num_layers
    chosen = frozenset(layers)
    if bad := sorted(i for i in chosen if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_layers):
        raise QuasarError(f"skip_layers: layer {bad[0]!r} does not exist (the model has layers 0..{num_layers - 1})")
    if not chosen or len(chosen) >= num_layers:
        raise QuasarError(f"skip_layers must name between 1 and {num_layers - 1} of the model's {num_layers} layers")
    return chosen


class LayerSkipDrafter:
    """Drafts k tokens with the verifier's ``skip_layers`` switched off, then truncates its cache back."""

    def __init__(self, lm: CausalLM, skip_layers: Iterable[int]):
        self.skip_layers = check_skip_layers(lm, skip_layers)
        self.lm = check_can_skip(lm)

    def _step(self, token: int) -> torch.Tensor:
        return self.lm.verify_skipping([token], self.skip_layers)[-1]

    def propose(self, tokens: Sequence[int], k: int, sampler: Sampler) -> Draft:
        start = self.lm.length
        try:
            return draft_autoregressive(self._step(tokens[-1]), self._step, k, sampler)
        finally:
            self.lm.truncate(start)


def layerskip_drafter(context: DrafterContext, options: Mapping[str, Any]) -> LayerSkipDrafter:
    """The registry's factory for "layerskip": explicit ``skip_layers``, or the context's choice for ``skip_fraction``."""
    layers, fraction = options["skip_layers"], options["skip_fraction"]
    if layers is not None and fraction is not None:
        raise QuasarError("give skip_layers or skip_fraction, not both")
    if layers is None:
        layers = context.choose_skip_layers(DEFAULT_SKIP_FRACTION if fraction is None else fraction)
    return LayerSkipDrafter(context.lm, layers)


def skip_order(lm: CausalLM, ids: Sequence[int], count: int, picked: Sequence[int] = ()) -> tuple[int, ...]:
    """The first ``count`` layers of the greedy skipping order on ``ids`` (each keeps the top-1 prediction best), continued
    from ``picked``. Clobbers the cache: call between generations."""
    lm = check_can_skip(lm)
    num_layers = lm.num_layers
    if not 1 <= count < num_layers:
        raise QuasarError(f"can skip between 1 and {num_layers - 1} of {num_layers} layers, not {count}")
    if len(ids) < 2:
        raise QuasarError("the text to choose skipped layers on must be at least 2 tokens")
    if len(picked) >= count:
        return tuple(picked[:count])

    def forward(skip: frozenset[int]) -> torch.Tensor:
        lm.truncate(0)
        return lm.verify_skipping(ids, skip)

    target = forward(frozenset()).argmax(-1)
    order = list(picked)
    while len(order) < count:
        best: tuple[float, float] | None = None
        for layer in range(num_layers):
            if layer in order:
                continue
            logits = forward(frozenset(order) | {layer})
            agreement = float((logits.argmax(-1) == target).float().mean())
            log_prob = float(torch.log_softmax(logits, -1).gather(-1, target[:, None]).mean())
            if best is None or (agreement, log_prob) > best:
                best, pick = (agreement, log_prob), layer
        order.append(pick)
    lm.truncate(0)
    return tuple(order)
