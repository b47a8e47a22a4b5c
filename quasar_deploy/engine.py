"""The Python API: ``load(path)`` gives an ``Engine`` whose ``generate`` and ``stream`` run the speculative loop.

``generate`` and ``stream`` run on the engine's one sequence, taking turns on a lock; ``open`` starts a generation on
a new sequence over the same weights, for a caller (the server's scheduler) that steps many generations itself.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .artifact import open_model_files
from .backends import registry
from .chat.renderer import RENDER_CHARS_PER_TOKEN, ChatRenderer
from .errors import QuasarError
from .integrity import listed_files, read_listed
from .speculative.acceptance import Sampler, SamplingParams
from .speculative.causal_lm import CausalLM, ForkingLM
from .speculative.draft_model import check_same_vocabulary
from .speculative.drafters import Drafter
from .speculative.layerskip import check_can_skip, skip_order
from .speculative.loop import LoopStats, Speculation
from .speculative.output_cache import OutputCache
from .speculative.registry import check_drafter_options, create_drafter, default_num_draft, drafter_entry
from .text import Detokenizer, StopStrings, check_text
from .tokenizer import read_tokenizer

# Short and mixed (prose and code), so the layers chosen for skipping suit whatever the model writes.
SKIP_CALIBRATION_TEXT = '''The quick brown fox jumps over the lazy dog. A language model predicts the next token from the ones before it.

def mean(values):
    """Return the arithmetic mean of a non-empty list of numbers."""
    total = 0
    for value in values:
        total += value
    return total / len(values)


class Counter:
    def __init__(self):
        self.counts = {}

    def add(self, key):
        self.counts[key] = self.counts.get(key, 0) + 1
'''

MAX_SEED = 2**64 - 1  # torch generators take 64-bit seeds

Message = Mapping[str, str]
Prompt = str | Sequence[Message] | Sequence[int]


@dataclass(frozen=True)
class GenerationOptions:
    """Everything ``generate`` and ``stream`` accept besides the prompt.

    ``draft`` names the drafter (plain decoding: "none"), ``num_draft`` its k (None: the drafter's own), ``adaptive_k`` makes
    k a cap; another drafter's options are an error. The same ``seed`` and options reproduce a sampled output. ``verify``:
    "exact" or "model" on an engine loaded with ``verify="exact"``; None is the engine's own mode."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    draft: str = "ngram"
    num_draft: int | None = None
    adaptive_k: bool = False
    ngram_min: int = 1
    ngram_max: int = 3
    suffix_min_prob: float = 0.1
    stop: Sequence[str] = ()
    skip_layers: Sequence[int] | None = None
    skip_fraction: float | None = None
    draft_model: str | Path | None = None
    verify: str | None = None

    def __post_init__(self) -> None:
        drafter_entry(self.draft)
        if self.verify is not None and self.verify not in VERIFY_MODES:
            raise QuasarError(f"unknown verify mode {self.verify!r}; choose from {', '.join(VERIFY_MODES)}")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if any(not isinstance(s, str) or not s for s in stop):
            raise QuasarError("stop strings must be non-empty strings")
        object.__setattr__(self, "stop", stop)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed <= MAX_SEED):
            raise QuasarError(f"seed must be an integer in [0, 2**64 - 1], got {self.seed!r}")
        if self.num_draft is None:
            object.__setattr__(self, "num_draft", default_num_draft(self.draft))
        if self.draft != "none" and (isinstance(self.num_draft, bool) or not isinstance(self.num_draft, int) or self.num_draft < 1):
            raise QuasarError(f"num_draft must be an integer >= 1 (for plain decoding use draft='none'), got {self.num_draft!r}")
        if not isinstance(self.adaptive_k, bool):
            raise QuasarError(f"adaptive_k must be true or false, got {self.adaptive_k!r}")
        if self.adaptive_k and self.draft == "none":
            raise QuasarError("adaptive_k needs a drafter; draft='none' drafts nothing")
        check_drafter_options(self.draft, [f.name for f in dataclasses.fields(self) if getattr(self, f.name) != f.default])

    @classmethod
    def from_kwargs(cls, options: Mapping[str, Any]) -> GenerationOptions:
        unknown = sorted(set(options) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise QuasarError(f"unknown generation option {unknown[0]!r}")
        return cls(**options)

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_k, self.top_p)


def _from_loop(name: str) -> property:
    """A read-only attribute of ``GenerationStats`` answered by its ``LoopStats``, so the two never disagree."""
    return property(lambda self: getattr(self.loop, name), doc=f"``LoopStats.{name}``")


@dataclass(frozen=True)
class GenerationStats:
    """The loop's counters plus what only the whole generation knows: tokens after stop strings, wall time from the prefill."""

    loop: LoopStats
    new_tokens: int
    wall_s: float

    verify_steps = _from_loop("verify_steps")
    drafted = _from_loop("drafted")
    accepted = _from_loop("accepted")
    acceptance_length = _from_loop("acceptance_length")
    prefill_s = _from_loop("prefill_s")
    draft_s = _from_loop("draft_s")
    verify_s = _from_loop("verify_s")

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first, per second after the prefill: the decoding speed, apart from the prompt's cost."""
        decode_s = self.wall_s - self.prefill_s
        return (self.new_tokens - 1) / decode_s if self.new_tokens > 1 and decode_s > 0 else 0.0

    def to_dict(self) -> dict[str, float | int]:
        """One flat record (what ``--stats`` prints and ``--json`` writes under "stats")."""
        return {
            "new_tokens": self.new_tokens,
            **dataclasses.asdict(self.loop),
            "acceptance_length": self.acceptance_length,
            "wall_s": self.wall_s,
            "tokens_per_s": self.tokens_per_s,
            "decode_tokens_per_s": self.decode_tokens_per_s,
        }


@dataclass(frozen=True)
class GenerationResult:
    """``tokens``: the new ids, a final stop token included; ``finish_reason``: "stop" or "length" (``context_full``: the window cut it)."""

    text: str
    tokens: list[int]
    stats: GenerationStats
    finish_reason: str
    prompt_tokens: int
    context_full: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {f.name: self.stats.to_dict() if f.name == "stats" else getattr(self, f.name) for f in dataclasses.fields(self)}


class Generation:
    """One generation over one sequence (its own ``CausalLM`` cache), advanced one verify step at a time: ``steps()``, or
    a scheduler's ``prefill()``, then ``draft()`` and ``settle(logits, began)`` per step until ``finished``. Between steps
    the cache holds a consistent prefix, so dropping a generation needs no cleanup."""

    def __init__(self, engine: Engine, lm: CausalLM, prompt: list[int], options: GenerationOptions):
        self._engine = engine
        self.lm = lm
        self.prompt = prompt
        self._max_new_tokens = options.max_new_tokens
        self._speculation = engine.speculation(lm, prompt, options)
        self.loop_stats = self._speculation.stats
        self._stops = StopStrings(options.stop)
        self._detokenizer = Detokenizer(engine.tokenizer, prompt)
        self._tokens: list[int] = []
        self._text: list[str] = []
        self._began = 0.0
        self.result: GenerationResult | None = None

    @property
    def finished(self) -> bool:
        return self.result is not None

    def steps(self) -> Iterator[list[str]]:
        yield self.prefill()
        while not self.finished:
            yield self._take(self._speculation.step())

    def prefill(self) -> list[str]:
        """Cache the prompt: the text of the first token."""
        self._began = time.perf_counter()
        return self._take(self._speculation.prefill())

    def settle_prefill(self, logits: torch.Tensor, prefill_began: float) -> list[str]:
        """The text of the first token, from the prompt's last ``logits`` that ``lm`` computed (a batched prefill)."""
        self._began = prefill_began
        return self._take(self._speculation.settle_prefill(logits, prefill_began))

    def draft(self) -> list[int]:
        """The token ids ``lm`` must verify next (the pending token and the drafted ones)."""
        return self._speculation.draft()

    def trim_draft(self, keep: int) -> list[int]:
        """The block ``draft`` returned, with only its first ``keep`` drafted tokens."""
        return self._speculation.trim(keep)

    @property
    def draft_acceptance(self) -> float:
        """The estimated chance a drafted token is kept once the ones before it were (``DraftLength.rate``)."""
        return self._speculation.draft_length.rate

    def settle(self, logits: torch.Tensor, verify_began: float) -> list[str]:
        """The text of the step whose block ``lm`` computed ``logits`` for (starting at ``time.perf_counter()`` ``verify_began``)."""
        return self._take(self._speculation.settle(logits, verify_began))

    def _take(self, step: list[int]) -> list[str]:
        pieces: list[str] = []
        stopped = False
        for token in step:
            self._tokens.append(token)
            piece, stopped = self._stops.push(self._detokenizer.push(token))
            if piece:
                pieces.append(piece)
            if stopped:
                break
        if not stopped and self._speculation.finished:
            tail, stopped = self._stops.push(self._detokenizer.flush())
            tail += self._stops.flush()
            if tail:
                pieces.append(tail)
        self._text.extend(pieces)
        if stopped or self._speculation.finished:
            self._finish(stopped)
        return pieces

    def _finish(self, stopped: bool) -> None:
        tokens = self._tokens
        stats = GenerationStats(self.loop_stats, len(tokens), time.perf_counter() - self._began)
        finish = "stop" if stopped or (tokens and tokens[-1] in self._engine.stop_ids) else "length"
        context_full = finish == "length" and len(tokens) < self._max_new_tokens
        self.result = GenerationResult("".join(self._text), tokens, stats, finish, len(self.prompt), context_full)
        if self._engine.output_cache is not None:
            self._engine.output_cache.add(tokens)


class Stream:
    """Iterates over text pieces as the verifier accepts them; ``result`` is set once the iteration ends."""

    def __init__(self, engine: Engine, prompt: Prompt, options: GenerationOptions):
        self._engine = engine
        self._generation = Generation(engine, engine.verifier(options), engine.encode(prompt), options)
        self._pieces = self._run()

    @property
    def result(self) -> GenerationResult | None:
        return self._generation.result

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        return next(self._pieces)

    def _run(self) -> Iterator[str]:
        with self._engine.exclusive():
            for pieces in self._generation.steps():
                yield from pieces


@dataclass(frozen=True)
class SequenceContext:
    """The drafter context of a sequence ``lm`` other than the engine's own; setup work stays cached in the engine."""

    engine: Engine
    lm: CausalLM

    def choose_skip_layers(self, fraction: float) -> frozenset[int]:
        return self.engine.choose_skip_layers(fraction)

    def draft_lm(self, path: str | Path) -> CausalLM:
        return check_can_fork(self.engine.draft_lm(path)).new_sequence()

    @property
    def output_cache(self) -> OutputCache | None:
        return self.engine.output_cache


def check_can_fork(lm: CausalLM) -> ForkingLM:
    """``lm`` once it is known to open more sequences over its weights; a one-line error for a backend that cannot."""
    if not isinstance(lm, ForkingLM):
        raise QuasarError(f"backend {getattr(lm, 'description', type(lm).__name__)!r} cannot open concurrent sequences")
    return lm


@dataclass
class Engine:
    """A verifier (any ``CausalLM`` backend) with its tokenizer; ``backend`` is also used to load draft models."""

    lm: CausalLM
    tokenizer: Any
    stop_ids: frozenset[int] = frozenset()
    backend: str = "cpu"
    _draft_lms: dict[str, CausalLM] = field(default_factory=dict, repr=False)
    _skip_orders: dict[str, tuple[int, ...]] = field(default_factory=dict, repr=False)  # greedy, by text
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _holder: int | None = field(default=None, repr=False)
    renderer: ChatRenderer | None = field(default=None, repr=False)  # chat templates (None: the bounds of ``chat.renderer``)
    # earlier generations' outputs, which suffix drafts may copy across generations (opt-in: speculative.output_cache)
    output_cache: OutputCache | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        eos = getattr(self.tokenizer, "eos_token_id", None)
        self.stop_ids = frozenset(self.stop_ids) | ({eos} if eos is not None else set())
        if self.renderer is None:
            self.renderer = ChatRenderer(self.tokenizer, RENDER_CHARS_PER_TOKEN * self.lm.max_length)

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the verifier (and its one KV cache): other threads wait; this thread may not nest a second generation."""
        if self._holder == threading.get_ident():
            raise QuasarError("this engine is busy with an unfinished stream in this thread; finish or close it first")
        with self._lock:
            self._holder = threading.get_ident()
            try:
                yield
            finally:
                self._holder = None

    def generate(self, prompt: Prompt, **options: Any) -> GenerationResult:
        """Generate a completion; ``options`` are ``GenerationOptions`` fields (max_new_tokens, temperature, draft, ...)."""
        stream = self.stream(prompt, **options)
        for _ in stream:
            pass
        return stream.result

    def stream(self, prompt: Prompt, **options: Any) -> Stream:
        """Like ``generate`` but yields text pieces as they are accepted; bad input raises here, before any work."""
        return Stream(self, prompt, GenerationOptions.from_kwargs(options))

    def encode(self, prompt: Prompt) -> list[int]:
        """Text, chat messages (through the tokenizer's chat template) or token ids, as the verifier's input ids."""
        if isinstance(prompt, bytes | bytearray | memoryview):
            raise QuasarError("the prompt is bytes; pass text as str (decode it first) or token ids as a list of ints")
        if isinstance(prompt, str):
            if not prompt:
                raise QuasarError("the prompt is empty")
            check_text(prompt, "the prompt")
            return list(self.tokenizer.encode(prompt))
        if not isinstance(prompt, Sequence) or len(prompt) == 0:
            raise QuasarError("the prompt is empty" if isinstance(prompt, Sequence) else f"unsupported prompt type {type(prompt).__name__}")
        if all(isinstance(m, Mapping) for m in prompt):
            return self._chat(prompt)
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            bad = next((t for t in prompt if not 0 <= t < self.lm.vocab_size), None)
            if bad is not None:
                raise QuasarError(f"token id {bad} is outside the vocabulary (0..{self.lm.vocab_size - 1})")
            return list(prompt)
        raise QuasarError("a prompt is a string, a list of chat messages ({'role', 'content'}) or a list of token ids")

    def _chat(self, messages: Sequence[Message]) -> list[int]:
        return self.renderer.render(self.chat_messages(messages))

    def chat_messages(self, messages: Sequence[Message]) -> list[dict[str, str]]:
        """``messages`` checked for the chat template (string role and content, text that encodes), as dicts for ``renderer``."""
        for m in messages:
            if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise QuasarError("each chat message needs a string 'role' and a string 'content'")
            check_text(m["content"], "a chat message")
        if not getattr(self.tokenizer, "chat_template", None):
            raise QuasarError("this model's tokenizer has no chat template; pass the prompt as plain text")
        return [dict(m) for m in messages]

    def drafter(self, options: GenerationOptions, lm: CausalLM | None = None) -> Drafter:
        """A fresh drafter for one generation (drafters keep per-sequence state) on the engine's sequence or on ``lm``."""
        context = self if lm is None or lm is self.lm else SequenceContext(self, lm)
        return create_drafter(options.draft, context, dataclasses.asdict(options))

    def speculation(self, lm: CausalLM, prompt: list[int], options: GenerationOptions) -> Speculation:
        """The decoding loop of one generation of ``prompt`` on ``lm`` (the engine's sequence or one opened over its weights)."""
        sampler = Sampler(options.sampling, options.seed)
        drafter = self.drafter(options, lm)
        return Speculation(
            lm, drafter, prompt, sampler, options.num_draft, options.max_new_tokens, self.stop_ids, LoopStats(), options.adaptive_k
        )

    def open(self, prompt: Sequence[int], options: GenerationOptions) -> Generation:
        """A generation of encoded ``prompt`` on a new sequence over the engine's weights, outside its lock: the caller drives it."""
        return Generation(self, check_can_fork(self.verifier(options)).new_sequence(), list(prompt), options)

    @property
    def verify_modes(self) -> tuple[str, ...]:
        """What a generation's ``verify`` may ask of this engine, its default first (``GenerationOptions.verify``)."""
        return ("model",)

    def verifier(self, options: GenerationOptions) -> CausalLM:
        """The model whose sequences verify a generation with ``options`` (a server batches their blocks on it)."""
        if options.verify == "exact":
            raise QuasarError("verify='exact' needs the engine loaded for it: load(artifact, verify='exact') (serve --verify exact)")
        return self.lm

    def cached_models(self, options: GenerationOptions) -> tuple[CausalLM, ...]:
        """Every model that keeps a KV cache for one generation with ``options``: its verifier's first."""
        return (self.verifier(options),)

    def choose_skip_layers(self, fraction: float, text: str = SKIP_CALIBRATION_TEXT) -> frozenset[int]:
        """The ``fraction`` of layers to skip when drafting that keeps the most top-1 agreement on ``text`` (order kept per text)."""
        if not (isinstance(fraction, int | float) and 0 < fraction < 1):
            raise QuasarError(f"skip_fraction must be in (0, 1), got {fraction!r}")
        num_layers = check_can_skip(self.lm).num_layers
        count = min(num_layers - 1, max(1, round(fraction * num_layers)))
        order = self._skip_orders.get(text, ())
        if len(order) < count:
            ids = list(self.tokenizer.encode(text))[: self.lm.max_length]
            with self.exclusive():
                order = self._skip_orders[text] = skip_order(self.lm, ids, count, order)
        return frozenset(order[:count])

    def draft_lm(self, path: str | Path) -> CausalLM:
        """The draft model at ``path`` on this engine's backend, loaded once; its tokenizer must match the verifier's."""
        key = str(Path(path).resolve())
        if key not in self._draft_lms:
            draft = open_engine(path, self.backend)
            check_same_vocabulary(self.tokenizer.get_vocab(), draft.tokenizer.get_vocab(), str(path))
            self._draft_lms[key] = draft.lm
        return self._draft_lms[key]


def open_engine(path: str | Path, backend: str, needs: Collection[str] = (), trust_remote_code: bool = False, **options: Any) -> Engine:
    """The engine of the model directory at ``path``, opened and verified once (its ``ModelFiles`` passed down), or of the
    export there, which no ``ModelFiles`` opens: its target's backend reads it (``create_export_backend``). Not warmed up."""
    if backend != "auto":
        registry.factory_options(backend, needs, options)  # a wrong choice costs no verification
    directory = Path(path)
    exported = registry.export_backend(backend, directory)
    if exported is not None:
        backend, lm = exported, registry.create_export_backend(exported, directory, needs, **options)
        listed = listed_files(directory)
    else:
        files = open_model_files(directory)
        backend = registry.resolve_backend(backend, files, needs, options)
        lm, listed = registry.create_backend(backend, files, needs, **options), files.listed
    return Engine(lm, read_tokenizer(directory, listed, trust_remote_code), stop_ids_of(directory, listed), backend)


def stop_ids_of(path: Path, listed: dict[str, str] | None) -> frozenset[int]:
    """End-of-sequence ids from ``generation_config.json`` and ``config.json`` as ``listed`` vouches, as HF's generate uses."""
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        data = read_listed(path, name, listed)
        if data is None:
            continue
        try:
            value = json.loads(data).get("eos_token_id")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError, RecursionError):
            raise QuasarError(f"{path / name}: not a valid JSON object") from None
        ids.update(value if isinstance(value, list) else [] if value is None else [value])
    return frozenset(i for i in ids if isinstance(i, int) and not isinstance(i, bool) and i >= 0)


VERIFY_MODES = ("model", "exact")  # whose output a generation returns: the model's (W8A8 verifier) or exact mode's


WARM_UP_BLOCK = 8  # verify blocks up to k+1 = 8 tokens get their kernels built at load


def warm_up(lm: CausalLM) -> None:
    """Run a prefill and every verify block size once, so one-time costs land in ``load``, not the first generation."""
    length = min(WARM_UP_BLOCK, lm.max_length - WARM_UP_BLOCK - 1)
    if length < 1:
        return
    lm.prefill([0] * length)
    for block in range(1, WARM_UP_BLOCK + 1):
        lm.verify([0] * block)
        lm.truncate(length)
    lm.truncate(0)
