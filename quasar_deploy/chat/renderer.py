"""Chat messages to prompt ids through the tokenizer's chat template, rendered in a process of their own (``worker``).

The template is read at each render, so one set after loading is used; the process starts again after it has gone."""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import json
import os
import pickle
import queue
import subprocess
import sys
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import QuasarError
from ..files import first_line
from .frames import SETUP, FrameError, FrameReader, frame, reply_limit, write_all

CHAT_TEMPLATE_SECONDS = 5.0  # a render's time, from its process's fork to its ids: the template's run and the tokenizing
RENDER_CHARS_PER_TOKEN = 16  # of the context window: a longer rendered prompt is refused before it is tokenized
RENDER_MEMORY_BYTES = 512 << 20  # the address space a render may add to the process it was forked from
RENDER_PROCESSES = 2  # renders at once; others wait their turn
START_SECONDS = 60.0  # beyond a render's own time: the renderer's process starting (Python, transformers, the tokenizer)
# the renderer's process must stay single-threaded to fork safely: no thread pools in the libraries it imports
SINGLE_THREADED = {"TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # where the renderer's process imports quasar_deploy from


class RendererError(QuasarError):
    """The renderer's process failed (not the template): a fault of the server, not of the request."""


class _Process:
    """One renderer process: a thread writes the frames to it (the setup first), another reads its replies."""

    def __init__(self, tokenizer: Any, bounds: dict[str, Any]):
        env = {**os.environ, **SINGLE_THREADED, "PYTHONPATH": os.pathsep.join(filter(None, [PACKAGE_ROOT, os.environ.get("PYTHONPATH")]))}
        command = [sys.executable, "-m", "quasar_deploy.chat.worker"]
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self.pending: dict[int, concurrent.futures.Future] = {}
        self.lock, self.stopped = threading.Lock(), False
        self.failure: str | None = None
        self.outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        setup = lambda: frame(SETUP, pickle.dumps({"tokenizer": tokenizer, **bounds}))  # noqa: E731
        threading.Thread(target=self._write, args=(setup,), name="quasar-chat-writer", daemon=True).start()
        threading.Thread(target=self._read, args=(reply_limit(bounds["max_chars"]),), name="quasar-chat-reader", daemon=True).start()

    def submit(self, tag: int, request: dict[str, Any]) -> concurrent.futures.Future:
        try:
            data = frame(tag, json.dumps(request).encode())
        except (TypeError, ValueError) as exc:
            raise QuasarError(f"a chat message holds what JSON cannot carry ({first_line(exc)})") from None
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self.lock:
            if self.stopped:
                raise RendererError(self._stopped_message())
            self.pending[tag] = future
        self.outbox.put(data)
        return future

    def cancel(self, tag: int) -> None:
        """Nobody waits for this render any more: its process is killed, or it never starts."""
        with self.lock:
            if self.pending.pop(tag, None) is None:
                return
        self.outbox.put(frame(tag, b'{"cancel": true}'))

    def stop(self) -> None:
        self.process.kill()
        self._fail_pending("the chat template renderer was stopped")

    def _write(self, setup: Callable[[], bytes]) -> None:
        fd = self.process.stdin.fileno()
        try:
            write_all(fd, setup())
            while (data := self.outbox.get()) is not None:
                write_all(fd, data)
        except OSError:  # the process has gone: the reader says why
            pass
        finally:
            self.process.stdin.close()

    def _read(self, limit: int) -> None:
        reader, fd = FrameReader(limit), self.process.stdout.fileno()
        try:
            while data := os.read(fd, 1 << 16):
                for tag, payload in reader.feed(data):
                    self._deliver(tag, payload)
        except (OSError, FrameError, ValueError, AttributeError) as exc:  # from the setup's reply too
            self.failure = f"the chat template renderer sent a broken reply ({first_line(exc)})"
            self.process.kill()
        self.process.wait()
        self.process.stdout.close()
        self._fail_pending(self._stopped_message())

    def _deliver(self, tag: int, payload: bytes) -> None:
        if tag == SETUP:
            error = json.loads(payload).get("error")
            self.failure = f"the chat template renderer cannot start: {error}" if error else None
            return
        with self.lock:
            future = self.pending.pop(tag, None)
        if future is not None and future.set_running_or_notify_cancel():
            future.set_result(payload)

    def _stopped_message(self) -> str:
        return self.failure or f"the chat template renderer stopped (exit code {self.process.returncode})"

    def _fail_pending(self, message: str) -> None:
        with self.lock:
            self.stopped = True
            futures, self.pending = list(self.pending.values()), {}
        self.outbox.put(None)
        for future in futures:
            if future.set_running_or_notify_cancel():
                future.set_exception(RendererError(message))


def token_ids(payload: bytes) -> list[int]:
    """A render's reply as ids, or its error raised (one line): what the renderer's process sends is checked, not trusted."""
    try:
        reply = json.loads(payload)
    except ValueError:
        reply = None
    if isinstance(reply, dict) and isinstance(reply.get("error"), str):
        lines = reply["error"].strip().splitlines()
        raise QuasarError(lines[0] if lines else "the chat template failed")
    ids = reply.get("ids") if isinstance(reply, dict) else None
    if isinstance(ids, list) and all(type(i) is int for i in ids):
        return ids
    raise RendererError("the chat template renderer sent a reply that is not token ids")


class ChatRenderer:
    """Renders chats with the tokenizer's template, within ``seconds``, ``max_chars``, ``memory_bytes``, ``processes``."""

    def __init__(
        self,
        tokenizer: Any,
        max_chars: int,
        seconds: float = CHAT_TEMPLATE_SECONDS,
        memory_bytes: int = RENDER_MEMORY_BYTES,
        processes: int = RENDER_PROCESSES,
    ):
        self.tokenizer, self.seconds = tokenizer, seconds
        self._bounds = {"seconds": seconds, "max_chars": max_chars, "memory_bytes": memory_bytes, "processes": processes}
        self._lock = threading.Lock()
        self._process: _Process | None = None
        self._tags = itertools.count(1)

    def start(self) -> None:
        """Start the renderer's process now rather than at the first render, which then waits only for itself."""
        self._live()

    def close(self) -> None:
        with self._lock:
            if self._process is not None:
                self._process.stop()

    @property
    def busy(self) -> int:
        """Renders asked for and not yet answered."""
        with self._lock:
            return 0 if self._process is None else len(self._process.pending)

    def render(self, messages: list[dict[str, str]]) -> list[int]:
        """The prompt ids of ``messages``; QuasarError (one line) when the template fails or passes a bound."""
        process, _, future = self._submit(messages)
        try:
            return token_ids(future.result(timeout=self.seconds + START_SECONDS))
        except concurrent.futures.TimeoutError:
            process.stop()
            raise RendererError(f"the chat template renderer did not answer within {self.seconds + START_SECONDS:g} s") from None

    async def render_async(self, messages: list[dict[str, str]]) -> list[int]:
        """``render`` for the event loop; cancelling the await cancels the render (its process is killed)."""
        process, tag, future = self._submit(messages)
        try:
            payload = await asyncio.wait_for(asyncio.wrap_future(future), self.seconds + START_SECONDS)
        except asyncio.TimeoutError:
            process.stop()
            raise RendererError(f"the chat template renderer did not answer within {self.seconds + START_SECONDS:g} s") from None
        except asyncio.CancelledError:
            process.cancel(tag)
            raise
        return token_ids(payload)

    def _submit(self, messages: list[dict[str, str]]) -> tuple[_Process, int, concurrent.futures.Future]:
        request = {"template": self.tokenizer.chat_template, "messages": messages}
        process, tag = self._live(), next(self._tags)
        return process, tag, process.submit(tag, request)

    def _live(self) -> _Process:
        with self._lock:
            if self._process is None or self._process.stopped:
                self._process = _Process(self.tokenizer, self._bounds)
                weakref.finalize(self, self._process.stop)  # the process ends with its renderer, or with this one
            return self._process
