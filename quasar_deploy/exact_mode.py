"""Exact mode's engine: the float model verifies and its output is returned; its W8A8 artifact drafts through a cascade.

Each generation gets its own W8A8 sequence, so the scheduler batches exact generations like any others."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .artifact import ModelFiles, open_model_files
from .backends import create_backend, resolve_backend
from .engine import Engine, GenerationOptions, check_can_fork, stop_ids_of, warm_up
from .errors import QuasarError
from .fidelity import reference_of
from .speculative.acceptance import Sampler
from .speculative.cascade import CascadeDrafter, CascadeStats, RoundPolicy, check_rounds
from .speculative.causal_lm import CausalLM
from .speculative.draft_model import check_same_vocabulary
from .speculative.drafters import RewindableDrafter
from .speculative.loop import Speculation
from .tokenizer import load_tokenizer


@dataclass
class ExactEngine(Engine):
    """An ``Engine`` whose verifier ``lm`` is the float model and whose drafts come from W8A8 rounds on ``middle``.

    ``rounds`` per float step, or None: chosen by timing (``cascade.RoundPolicy``), so a seed may not reproduce."""

    middle: CausalLM | None = None
    rounds: int | None = None
    source: Path | None = None  # the float checkpoint ``lm`` was loaded from
    _chosen_rounds: RoundPolicy | None = field(default=None, init=False, repr=False)

    def round_policy(self) -> RoundPolicy:
        """Fixed ``rounds``: a policy per generation. Else one for all this engine's generations (costs and acceptance
        belong to the models, not a prompt), so where rounds do not pay a new generation never runs one."""
        if self.rounds is not None:
            return RoundPolicy(self.rounds)
        if self._chosen_rounds is None:
            self._chosen_rounds = RoundPolicy()
        return self._chosen_rounds

    @property
    def verify_modes(self) -> tuple[str, ...]:
        return ("exact", "model")

    def verifier(self, options: GenerationOptions) -> CausalLM:
        """The float model, or the W8A8 one for a generation that asks for its own output (``verify="model"``)."""
        return self.middle if options.verify == "model" else self.lm

    def cached_models(self, options: GenerationOptions) -> tuple[CausalLM, ...]:
        """Exact: the float model's cache and the W8A8 one its rounds draft on; ``verify="model"``: the W8A8 one."""
        return (self.middle,) if options.verify == "model" else (self.lm, self.middle)

    def speculation(self, lm: CausalLM, prompt: list[int], options: GenerationOptions) -> Speculation:
        if options.verify == "model":  # the W8A8 model's own output: plain speculative decoding on it
            return super().speculation(lm, prompt, options)
        check_rounds(self.rounds)
        if options.adaptive_k:  # the cascade sizes its drafts itself (``cascade.RoundPolicy``)
            raise QuasarError("adaptive_k applies to verify='model' here; verify='exact' sizes its drafts by its round policy")
        inner = self.drafter(options, lm)
        if not isinstance(inner, RewindableDrafter):
            raise QuasarError(f"draft={options.draft!r} cannot draft for verify='exact' (it cannot take back a rejected draft)")
        middle = self.middle if lm is self.lm else check_can_fork(self.middle).new_sequence()
        stats = CascadeStats()
        drafter = CascadeDrafter(middle, inner, options.num_draft, self.stop_ids, self.round_policy(), stats)
        sampler = Sampler(options.sampling, options.seed)
        # the float step may take every token the rounds made: the loop caps a draft at the room left
        return Speculation(lm, drafter, prompt, sampler, lm.max_length, options.max_new_tokens, self.stop_ids, stats)


def float_source(artifact: ModelFiles, source: str | Path | None = None) -> ModelFiles:
    """The float checkpoint exact mode verifies with, opened: ``source``, else the one ``artifact``'s manifest records."""
    if not artifact.is_artifact:
        raise QuasarError(f"{artifact.path}: verify='exact' takes a W8A8 artifact (it drafts for its float model), not a float checkpoint")
    path = source if source is not None else reference_of(artifact, "exact_source (--exact-source MODEL_DIR), its float checkpoint")
    files = open_model_files(path)
    if files.is_artifact:
        raise QuasarError(f"{files.path}: the exact source must be the float checkpoint, not a W8A8 artifact")
    return files


def load_exact(
    path: str | Path,
    source: str | Path | None = None,
    backend: str = "auto",
    trust_remote_code: bool = False,
    needs: tuple[str, ...] | list[str] = (),
    **backend_options: Any,
) -> ExactEngine:
    """Both weight sets on one backend (with "auto", the float checkpoint's): the float checkpoint (``float_source``)
    verifying, the artifact at ``path`` drafting; they must share tokenizer and context window."""
    artifact = open_model_files(path)  # it and its float source are each opened and verified once
    source = float_source(artifact, source)
    name = resolve_backend(backend, source, needs, backend_options)
    verifier = create_backend(name, source, **backend_options)
    middle = create_backend(name, artifact, **backend_options)
    if (middle.vocab_size, middle.max_length) != (verifier.vocab_size, verifier.max_length):
        raise QuasarError(
            f"{path}: vocabulary {middle.vocab_size} and context {middle.max_length}, but its float source {source.path} has "
            f"{verifier.vocab_size} and {verifier.max_length}; exact mode needs the artifact of that checkpoint"
        )
    tokenizer = load_tokenizer(source, trust_remote_code)
    check_same_vocabulary(tokenizer.get_vocab(), load_tokenizer(artifact, trust_remote_code).get_vocab(), str(path))
    engine = ExactEngine(verifier, tokenizer, stop_ids_of(source.path, source.listed), name, middle=middle, source=source.path)
    warm_up(verifier)
    warm_up(middle)
    return engine
