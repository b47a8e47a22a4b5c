"""One worker thread runs every admitted request's generation, each on its own sequence, one verify step at a time.

Round-robin, first increment: each round admits waiting requests into free slots,
drops cancelled sequences, then advances every running sequence by one verify step
(``_step_all``). No request waits for another to finish, a new one starts at the next
round, and every sequence's output is what it would be alone (its own KV cache, its
own sampler). The weights are shared; the forwards are not batched. The batched
increment replaces ``_step_all`` with one forward over all sequences' rows (pending
token plus k_i drafts each, M = sum of k_i + 1), which needs the speculative loop split
into draft / verify / accept phases; admission, cancellation and delivery stay as they are.

The scheduler knows nothing of HTTP or asyncio: each ticket carries a ``deliver``
callable that the server points at the request's event queue.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from ..engine import Engine, Generation, GenerationOptions, GenerationResult
from ..errors import QuasarError
from ..files import first_line
from .metrics import Metrics
from .protocol import ApiError, Request


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


class QueueFull(Exception):
    """Every slot is busy and the waiting queue is at its bound."""


@dataclass(eq=False)
class Ticket:
    """One request's place in the scheduler; ``deliver`` is called from the worker thread with each event in order."""

    request: Request
    deliver: Callable[[Event], None]
    submitted: float = field(default_factory=time.monotonic)
    cancelled: bool = False


@dataclass(eq=False)
class Running:
    """A sequence being generated, with the loop counters last seen (to turn totals into per-step metrics)."""

    ticket: Ticket
    generation: Generation
    steps: Iterator[list[str]]
    first_step_done: bool = False
    verify_steps: int = 0
    accepted: int = 0
    verify_s: float = 0.0


class Scheduler:
    """Admission (``max_sequences`` running, ``max_queue`` waiting), cancellation and the round-robin worker."""

    def __init__(self, engine: Engine, metrics: Metrics, max_sequences: int = 8, max_queue: int = 32):
        self.engine, self.metrics = engine, metrics
        self.max_sequences, self.max_queue = max_sequences, max_queue
        self._waiting: deque[Ticket] = deque()
        self._running: list[Running] = []
        self._wake = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._work, name="quasar-scheduler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Cancel everything and end the worker (running sequences are closed, waiting ones told the server stopped)."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join()

    @property
    def busy(self) -> int:
        """Requests admitted and not yet finished: waiting plus running."""
        return len(self._waiting) + len(self._running)

    def submit(self, ticket: Ticket) -> None:
        with self._wake:
            if self.busy >= self.max_sequences + self.max_queue:
                raise QueueFull
            self._waiting.append(ticket)
            self.metrics.queue_depth.set(len(self._waiting))
            self._wake.notify()

    def cancel(self, ticket: Ticket) -> None:
        """The client went away: its sequence leaves at the next round (a no-op once it has finished)."""
        with self._wake:
            ticket.cancelled = True
            self._wake.notify()

    def _work(self) -> None:
        while True:
            with self._wake:
                self._wake.wait_for(lambda: self._stopping or self._waiting or self._running)
                if self._stopping:
                    break
                free = self.max_sequences - len(self._running)
                admitted = [self._waiting.popleft() for _ in range(min(free, len(self._waiting)))]
                self.metrics.queue_depth.set(len(self._waiting))
            for ticket in admitted:
                if not ticket.cancelled:
                    self._open(ticket)
            self._drop_cancelled()
            self._step_all()
        for running in self._running:
            running.steps.close()
        for ticket in self._waiting:
            ticket.deliver(Failed(ApiError(503, "the server is shutting down")))
        self._running.clear()
        self._waiting.clear()

    def _open(self, ticket: Ticket) -> None:
        """Tokenize, cap ``max_tokens`` at the context window and open the sequence; a bad prompt fails the ticket with 400."""
        request = ticket.request
        try:
            ids = self.engine.encode(request.prompt)
            room = self.engine.lm.max_length - len(ids)
            if room < 1:
                raise QuasarError(f"the prompt is {len(ids)} tokens; the context window is {self.engine.lm.max_length}")
            max_tokens = min(request.max_tokens or room, room)
            generation = self.engine.open(ids, GenerationOptions(max_new_tokens=max_tokens, **request.options))
        except QuasarError as exc:
            ticket.deliver(Failed(ApiError(400, str(exc), "messages" if request.chat else "prompt")))
            return
        self._running.append(Running(ticket, generation, generation.steps()))
        self.metrics.running.set(len(self._running))
        ticket.deliver(Started(len(ids), max_tokens))

    def _drop_cancelled(self) -> None:
        for running in [r for r in self._running if r.ticket.cancelled]:
            running.steps.close()
            self._running.remove(running)
        self.metrics.running.set(len(self._running))

    def _step_all(self) -> None:
        """One round: every running sequence advances one verify step (the prefill, for one just admitted)."""
        for running in list(self._running):
            if not self._advance(running):
                self._running.remove(running)
        self.metrics.running.set(len(self._running))

    def _advance(self, running: Running) -> bool:
        """One step of one sequence, its text delivered; False once it has finished or failed."""
        ticket = running.ticket
        try:
            pieces = next(running.steps)
        except StopIteration:
            result = running.generation.result
            self.metrics.prompt_tokens.inc(result.prompt_tokens)
            self.metrics.generation_tokens.inc(len(result.tokens))
            ticket.deliver(Done(result))
            return False
        except Exception as exc:  # a failing sequence must not take the others (or the worker) down
            ticket.deliver(Failed(ApiError(500, f"generation failed: {first_line(exc)}")))
            return False
        self._observe(running)
        text = "".join(pieces)
        if text:
            ticket.deliver(Text(text))
        return True

    def _observe(self, running: Running) -> None:
        stats = running.generation.loop_stats
        if not running.first_step_done:
            running.first_step_done = True
            self.metrics.time_to_first_token.observe(time.monotonic() - running.ticket.submitted)
        if stats.verify_steps > running.verify_steps:
            self.metrics.acceptance_length.observe(1 + stats.accepted - running.accepted)
            self.metrics.verify_step.observe(stats.verify_s - running.verify_s)
            running.verify_steps, running.accepted, running.verify_s = stats.verify_steps, stats.accepted, stats.verify_s
