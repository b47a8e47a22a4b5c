"""What the verifier's distribution is, and which drafted tokens it keeps.

Greedy: the verifier's own decode, token for token; sampled: its distribution (Leviathan et al. 2023 / Chen et al. 2023)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import QuasarError

MIN_TEMPERATURE = 1e-5  # below this, logits / temperature leave float32's range (NaN probabilities); 0 means greedy


@dataclass(frozen=True)
class SamplingParams:
    """``temperature`` 0 means greedy; ``top_k`` 0 and ``top_p`` 1 switch those filters off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, int | float) and math.isfinite(self.temperature) and self.temperature >= 0):
            raise QuasarError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise QuasarError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise QuasarError(f"top_k must be an integer >= 0 (0: off), got {self.top_k!r}")
        if not (isinstance(self.top_p, int | float) and 0 < self.top_p <= 1):
            raise QuasarError(f"top_p must be in (0, 1], got {self.top_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Sampler:
    """The sampling parameters and the one seeded generator all a generation's random choices draw from."""

    def __init__(self, params: SamplingParams, seed: int | None = None):
        self.params = params
        self.generator = torch.Generator()
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    @property
    def greedy(self) -> bool:
        return self.params.greedy

    def distribution(self, logits: torch.Tensor) -> torch.Tensor:
        """Probabilities after temperature, top-k and top-p (Hugging Face's order), row-wise; top-p keeps at least one."""
        p = self.params
        x = logits.float() / p.temperature
        if 0 < p.top_k < x.shape[-1]:
            kth = torch.topk(x, p.top_k, dim=-1).values[..., -1:]
            x = x.masked_fill(x < kth, -math.inf)
        probs = torch.softmax(x, dim=-1)
        if p.top_p < 1:
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            drop_sorted = sorted_probs.cumsum(-1) - sorted_probs >= p.top_p
            drop_sorted[..., 0] = False
            drop = drop_sorted.scatter(-1, order, drop_sorted)
            probs = probs.masked_fill(drop, 0.0)
            probs = probs / probs.sum(-1, keepdim=True)
        return probs

    def sample(self, probs: torch.Tensor) -> int:
        return int(torch.multinomial(probs, 1, generator=self.generator))

    def uniform(self) -> float:
        return float(torch.rand((), generator=self.generator))

    def draw(self, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        """A drafter's pick from ``logits`` [vocab] and the distribution it came from (None: greedy, a deterministic pick)."""
        if self.greedy:
            return int(logits.argmax()), None
        probs = self.distribution(logits)
        return self.sample(probs), probs


@dataclass(frozen=True)
class Verdict:
    """``accepted`` drafted tokens survived; ``tokens`` is them plus the verifier's own next token (corrected or bonus)."""

    accepted: int
    tokens: list[int]


def accept(logits: torch.Tensor, draft: Sequence[int], draft_probs: torch.Tensor | None, sampler: Sampler) -> Verdict:
    """Judge ``draft`` against the verifier's ``logits`` [len(draft)+1, vocab]; ``draft_probs``: each one's q, or None."""
    if not torch.isfinite(logits).all():
        raise QuasarError("the model produced a non-finite logit (NaN or infinity); its weights or numerics are broken")
    if sampler.greedy:
        return accept_greedy(logits, draft)
    return accept_sampled(sampler.distribution(logits), draft, draft_probs, sampler)


def accept_greedy(logits: torch.Tensor, draft: Sequence[int]) -> Verdict:
    targets = logits.argmax(-1).tolist()
    n = 0
    while n < len(draft) and draft[n] == targets[n]:
        n += 1
    return Verdict(n, [*draft[:n], targets[n]])


def accept_sampled(probs: torch.Tensor, draft: Sequence[int], draft_probs: torch.Tensor | None, sampler: Sampler) -> Verdict:
    """Rejection sampling: keep x with probability min(1, p(x)/q(x)), else draw from max(0, p - q) (q: one-hot if None)."""
    for i, x in enumerate(draft):
        p = probs[i]
        ratio = float(p[x]) if draft_probs is None else float(p[x] / draft_probs[i, x])
        if sampler.uniform() < ratio:
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[x] = 0.0
        else:
            residual = (p - draft_probs[i]).clamp_min(0.0)
        total = float(residual.sum())
        # total is 0 only when p equals q (or p is one-hot on x), where the draft is always kept; rounding can still land here.
        return Verdict(i, [*draft[:i], sampler.sample(residual / total if total > 0 else p)])
    return Verdict(len(draft), [*draft, sampler.sample(probs[len(draft)])])
