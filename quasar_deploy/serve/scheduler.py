"""One worker thread runs every admitted request's generation, each on its own sequence, one verify step per round.

Where the backend batches, a round's blocks run in one forward per verifying model; each sequence settles on its own
(its cache, its seeded sampler), so its output is what it would be alone (docs/architecture.md, "Serving")."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from ..cpu.machine import memory_available
from ..cpu.threads import release_openmp_pool
from ..engine import Engine, Generation, GenerationOptions, GenerationResult
from ..errors import QuasarError
from ..files import first_line
from ..speculative.causal_lm import BatchVerifyingLM
from .metrics import Metrics
from .protocol import ApiError, Request
from .row_budget import RowBudget


@dataclass(frozen=True)
class Started:
    """Admitted and prefilling: the prompt was valid and fits the window; ``max_tokens`` is the cap actually applied."""

    prompt_tokens: int
    max_tokens: int


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class Done:
    result: GenerationResult


@dataclass(frozen=True)
class Failed:
    error: ApiError


Event = Started | Text | Done | Failed
T = TypeVar("T")

PREFILL_TOKENS = 256  # prompt tokens prefilled per round (at least one piece): the running sequences wait for them
PASS_LIMIT = 8  # rounds a waiting prompt may be passed over by later, shorter ones before it goes first


class QueueFull(Exception):
    """Every slot is busy and the waiting queue is at its bound."""


HOST_KV_SHARE = 0.5  # of the memory available once the model is loaded: room for the process's own growth and the OS
DEVICE_KV_SHARE = 0.9  # of a CUDA device's free memory: activations and graphs need the rest


def default_kv_cache_bytes(lm) -> int | None:
    """The KV cache running requests may hold without ``--kv-cache-mib``: a share of memory free after loading, or None."""
    device = str(getattr(lm, "device", "cpu"))
    if device == "cpu":
        return int(memory_available() * HOST_KV_SHARE)
    if device.startswith("cuda"):
        return int(torch.cuda.mem_get_info(torch.device(device))[0] * DEVICE_KV_SHARE)
    return None


def kv_cache_bytes(lm, tokens: int) -> int | None:
    """The KV cache bytes a sequence of ``lm`` holds at ``tokens`` positions, if its backend says (``kv_cache_bytes``)."""
    measure = getattr(lm, "kv_cache_bytes", None)
    return measure(tokens) if callable(measure) else None


@dataclass(eq=False)
class Ticket:
    """One request's place in the scheduler; ``deliver`` is called from the worker thread with each event in order."""

    request: Request
    deliver: Callable[[Event], None]
    submitted: float = field(default_factory=time.monotonic)
    cancelled: bool = False


@dataclass(eq=False)
class Running:
    """A sequence being generated (``done`` once finished or failed), with the loop counters last seen."""

    ticket: Ticket
    generation: Generation
    kv_bytes: int = 0  # the KV cache reserved for it at admission: its prompt and max_tokens
    batcher: BatchVerifyingLM | None = None  # the model whose batched forward verifies it (None: it verifies alone)
    done: bool = False
    first_step_done: bool = False
    prompt_done: int = 0  # prompt tokens prefilled (a backend with a ``prefill_chunk`` takes them a piece per round)
    prefill_began: float | None = None  # when its first piece ran (``time.perf_counter``)
    passed_over: int = 0  # rounds in which a sequence admitted after it prefilled while it waited (``_prefill_turn``)
    verify_steps: int = 0
    accepted: int = 0


class Scheduler:
    """Admission (``max_sequences``, ``max_queue``, ``kv_cache_bytes``), cancellation, deadlines and the worker."""

    def __init__(
        self,
        engine: Engine,
        metrics: Metrics,
        max_sequences: int = 8,
        max_queue: int = 32,
        prefill_tokens: int = PREFILL_TOKENS,
        deadline_s: float | None = None,
        kv_cache_bytes: int | None = None,
        row_budget: bool = True,
    ):
        self.engine, self.metrics = engine, metrics
        self.row_budget = RowBudget() if row_budget else None
        self.max_sequences, self.max_queue, self.prefill_tokens = max_sequences, max_queue, prefill_tokens
        self.deadline_s, self.kv_cache_bytes = deadline_s, kv_cache_bytes
        self._waiting: deque[Ticket] = deque()
        self._running: list[Running] = []
        self._wake, self._stopping = threading.Condition(), False
        self._ending: ApiError | None = None  # set by ``end_all``: every request ends with it
        self._thread = threading.Thread(target=self._work, name="quasar-scheduler", daemon=True)
        release_openmp_pool()  # the worker runs the model at full speed only once this thread's pool is gone

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Cancel everything and end the worker (running sequences are dropped, waiting ones told the server stopped)."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join()

    @property
    def busy(self) -> int:
        """Requests admitted and not yet finished: waiting plus running."""
        return len(self._waiting) + len(self._running)

    def submit(self, ticket: Ticket) -> None:
        """Queue ``ticket``; QueueFull at the bounds, and after ``end_all`` its error."""
        with self._wake:
            if self._ending is not None:
                raise ApiError(self._ending.status, self._ending.message)
            if self.busy >= self.max_sequences + self.max_queue:
                raise QueueFull
            self._waiting.append(ticket)
            self.metrics.queue_depth.set(len(self._waiting))
            self._wake.notify()

    def cancel(self, ticket: Ticket) -> None:
        """The client went away: a waiting ticket leaves the queue now, a running sequence at the next round."""
        with self._wake:
            ticket.cancelled = True
            if ticket in self._waiting:
                self._waiting.remove(ticket)
                self.metrics.queue_depth.set(len(self._waiting))
            self._wake.notify()

    def end_all(self, error: ApiError) -> None:
        """Every request here ends now with ``error`` (a drain's deadline), and every one submitted later is refused."""
        with self._wake:
            self._ending = error
            for ticket in [*self._waiting, *(running.ticket for running in self._running)]:
                self._end(ticket, error)
            self._waiting.clear()
            self.metrics.queue_depth.set(0)
            self._wake.notify()

    @staticmethod
    def _end(ticket: Ticket, error: ApiError) -> None:
        if not ticket.cancelled:
            ticket.cancelled = True
            ticket.deliver(Failed(error))

    def _work(self) -> None:
        while True:
            with self._wake:
                self._wake.wait_for(lambda: self._stopping or self._waiting or self._running)
                if self._stopping:
                    break
            opened = 0  # a burst joins this round, but a flood of requests that fail to open (400) cannot hold the others
            while opened < self.max_sequences + self.max_queue and (admitted := self._admit()):
                opened += len(admitted)
                for ticket in admitted:
                    if not ticket.cancelled and not self._expired(ticket):
                        self._open(ticket)
            if self._ending is not None:  # those admitted while ``end_all`` ran
                for running in self._running:
                    self._end(running.ticket, self._ending)
            self._drop_ended()
            self._step_all()
        for ticket in self._waiting:
            ticket.deliver(Failed(ApiError(503, "the server is shutting down")))  # the app adds Retry-After
        self._running.clear()
        self._waiting.clear()

    def _admit(self) -> list[Ticket]:
        """The waiting tickets that take the free slots, in arrival order."""
        with self._wake:
            free = self.max_sequences - len(self._running)
            admitted = [self._waiting.popleft() for _ in range(min(free, len(self._waiting)))]
            self.metrics.queue_depth.set(len(self._waiting))
            return admitted

    def _open(self, ticket: Ticket) -> None:
        """Tokenize, cap ``max_tokens`` at the context window and open the sequence; a bad prompt fails the ticket with 400."""
        request = ticket.request
        try:
            ids = self.engine.encode(request.prompt)
            room = self.engine.lm.max_length - len(ids)
            if room < 1:
                raise QuasarError(f"the prompt is {len(ids)} tokens; the context window is {self.engine.lm.max_length}")
            max_tokens = min(request.max_tokens, room)
            options = GenerationOptions(max_new_tokens=max_tokens, **request.options)
            kv_bytes = self._admit_kv(self.engine.cached_models(options), len(ids) + max_tokens)
            generation = self.engine.open(ids, options)
            verifier = self.engine.verifier(options)
        except (QuasarError, ApiError) as exc:
            ticket.deliver(Failed(exc if isinstance(exc, ApiError) else ApiError(400, str(exc), "messages" if request.chat else "prompt")))
            return
        batcher = verifier if isinstance(verifier, BatchVerifyingLM) else None
        self._running.append(Running(ticket, generation, kv_bytes, batcher))
        self.metrics.running.set(len(self._running))
        ticket.deliver(Started(len(ids), max_tokens))

    def _admit_kv(self, models: tuple, tokens: int) -> int:
        """The KV cache bytes to reserve for ``tokens`` positions of ``models``: 429 if they do not fit now, 400 if never."""
        known = [size for size in (kv_cache_bytes(model, tokens) for model in models) if size is not None]
        if not known or self.kv_cache_bytes is None:
            return 0
        need, mib = sum(known), 1 << 20
        if need > self.kv_cache_bytes:
            raise ApiError(
                400,
                f"this request needs {need / mib:,.1f} MiB of KV cache ({tokens} tokens), more than the server's "
                f"{self.kv_cache_bytes / mib:,.1f} MiB; ask for fewer max_tokens",
                "max_tokens",
            )
        reserved = sum(r.kv_bytes for r in self._running)
        if reserved + need > self.kv_cache_bytes:
            full = f"{reserved / mib:,.1f} of {self.kv_cache_bytes / mib:,.1f} MiB"
            raise ApiError(429, f"the server's KV cache is full ({full} reserved by running requests); retry later")
        return need

    def _expired(self, ticket: Ticket) -> bool:
        """Whether ``ticket`` has passed its deadline; if so it is told (504), once."""
        if self.deadline_s is None or time.monotonic() - ticket.submitted <= self.deadline_s:
            return False
        ticket.cancelled = True
        ticket.deliver(Failed(ApiError(504, f"the request ran past the server's limit of {self.deadline_s:g} s", code="timeout")))
        return True

    def _drop_ended(self) -> None:
        """Cancelled sequences leave (their caches with them), and those past their deadline end (504)."""
        self._running = [r for r in self._running if not r.ticket.cancelled and not self._expired(r.ticket)]
        self.metrics.running.set(len(self._running))

    def _step_all(self) -> None:
        """One round: new sequences prefill, the others take one verify step; finished and failed ones leave."""
        fresh = self._prefill_turn()
        ready = [r for r in self._running if r.first_step_done]
        drafted = [(r, block) for r in ready if (block := self._attempt(r, r.generation.draft)) is not None]
        if self.row_budget is not None:
            drafted = [(r, self._within_budget(r, block)) for r, block in drafted]
        batchers = list({id(r.batcher): r.batcher for r, _ in fresh + drafted if r.batcher is not None}.values())
        for batcher in batchers:  # one forward per model that verifies (two on an exact engine serving both outputs)
            self._step_batched(batcher, [m for m in fresh if m[0].batcher is batcher], [m for m in drafted if m[0].batcher is batcher])
        for running, _ in fresh:
            if running.batcher is None:
                self._advance(running, running.generation.prefill)
        for running, block in drafted:
            if running.batcher is None:
                self._advance(running, lambda g=running.generation, block=block: self._verify_alone(g, block))
        self._running = [r for r in self._running if not r.done]
        self.metrics.running.set(len(self._running))

    def _within_budget(self, running: Running, block: list[int]) -> list[int]:
        """``block`` without the drafted rows the row budget does not pay for (batched sequences only)."""
        if running.batcher is None:
            return block
        keep = self.row_budget.keep(running.generation.draft_acceptance, len(block) - 1)
        return block if keep == len(block) - 1 else running.generation.trim_draft(keep)

    def _prefill_turn(self) -> list[tuple[Running, list[int]]]:
        """This round's prompt pieces, up to ``prefill_tokens`` (at least one): fewest left first, within ``PASS_LIMIT``."""
        waiting = [r for r in self._running if not r.first_step_done]
        order = sorted(waiting, key=lambda r: (r.passed_over < PASS_LIMIT, len(r.generation.prompt) - r.prompt_done))
        turn, tokens = [], 0
        for running in order:
            chunk = getattr(running.batcher, "prefill_chunk", None)
            prompt = running.generation.prompt
            piece = list(prompt[running.prompt_done : running.prompt_done + chunk]) if chunk else list(prompt)
            tokens += len(piece)
            if turn and tokens > self.prefill_tokens:
                break
            turn.append((running, piece))
        chosen = {id(running) for running, _ in turn}
        latest = max(i for i, running in enumerate(waiting) if id(running) in chosen) if turn else -1
        for running in waiting[:latest]:  # admitted before one that prefills now, and not prefilling: passed over
            running.passed_over += id(running) not in chosen
        return turn

    def _step_batched(
        self, batcher: BatchVerifyingLM, fresh: list[tuple[Running, list[int]]], drafted: list[tuple[Running, list[int]]]
    ) -> None:
        """The prompt pieces of ``fresh`` and the blocks of ``drafted`` in one forward of ``batcher``, then each settles."""
        members = [(r, piece, True) for r, piece in fresh] + [(r, block, False) for r, block in drafted]
        blocks = [block for _, block, _ in members]
        prefills = [prefill for _, _, prefill in members]
        accepted_before = sum(running.generation.loop_stats.accepted for running, _ in drafted)
        began = time.perf_counter()
        try:
            logits = batcher.verify_batch([running.generation.lm for running, _, _ in members], blocks, prefills)
        except Exception as exc:  # one forward for all: its failure is every one of theirs
            for running, _, _ in members:
                self._fail(running, exc)
            return
        seconds = time.perf_counter() - began
        if drafted:  # one observation per forward, however many sequences it verified
            self.metrics.verify_step.observe(seconds)
        for (running, block, prefill), rows in zip(members, logits):
            if not prefill:
                self._advance(running, lambda g=running.generation, rows=rows: g.settle(rows, began))
                continue
            running.prefill_began = running.prefill_began or began
            running.prompt_done += len(block)
            if running.prompt_done == len(running.generation.prompt):
                self._advance(running, lambda r=running, rows=rows: r.generation.settle_prefill(rows, r.prefill_began))
        if self.row_budget is not None and drafted and not fresh:  # verify blocks only: a prompt's rows cost more
            emitted = len(drafted) + sum(running.generation.loop_stats.accepted for running, _ in drafted) - accepted_before
            self.row_budget.observe(sum(map(len, blocks)), len(drafted), seconds, emitted)

    def _attempt(self, running: Running, call: Callable[[], T]) -> T | None:
        """``call()``; if it raises, the sequence fails alone (None) and the others, and the worker, go on."""
        try:
            return call()
        except Exception as exc:
            self._fail(running, exc)
            return None

    def _fail(self, running: Running, exc: Exception) -> None:
        running.done = True
        running.ticket.deliver(Failed(ApiError(500, f"generation failed: {first_line(exc)}")))

    def _advance(self, running: Running, step: Callable[[], list[str]]) -> None:
        """Take one step of one sequence and deliver its text, then its result once it has finished."""
        if (pieces := self._attempt(running, step)) is None:
            return
        self._observe(running)
        if text := "".join(pieces):
            running.ticket.deliver(Text(text))
        if (result := running.generation.result) is not None:
            running.done = True
            self.metrics.prompt_tokens.inc(result.prompt_tokens)
            self.metrics.generation_tokens.inc(len(result.tokens))
            running.ticket.deliver(Done(result))

    def _observe(self, running: Running) -> None:
        stats = running.generation.loop_stats
        if not running.first_step_done:
            running.first_step_done = True
            self.metrics.time_to_first_token.observe(time.monotonic() - running.ticket.submitted)
        if stats.verify_steps > running.verify_steps:
            self.metrics.acceptance_length.observe(1 + stats.accepted - running.accepted)
            running.verify_steps, running.accepted = stats.verify_steps, stats.accepted

    def _verify_alone(self, generation: Generation, block: list[int]) -> list[str]:
        began = time.perf_counter()
        logits = generation.lm.verify(block)
        self.metrics.verify_step.observe(time.perf_counter() - began)
        return generation.settle(logits, began)
