"""A live server for tests: the app under uvicorn in a thread on 127.0.0.1 and a free port, stopped on exit."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import uvicorn

START_TIMEOUT_S = 30


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(base: str, timeout: float = START_TIMEOUT_S, process=None) -> None:
    """Until /health answers 200; a server ``process`` that exits meanwhile fails at once, with its stderr."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}: {process.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"no server answered at {base} within {timeout} s")


@contextmanager
def live_server(app) -> Iterator[str]:
    """The base URL (``http://127.0.0.1:PORT``) of ``app`` served in a thread."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base)
        yield base
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def metric(base: str, name: str, headers: dict | None = None) -> float:
    """One sample's value from /metrics (the first line that starts with ``name``)."""
    text = httpx.get(f"{base}/metrics", headers=headers or {}, timeout=5).text
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ") or line.startswith(name + "{")))


class SlowLM:
    """A ``CausalLM`` whose verify steps take at least ``delay`` seconds: a long generation on a tiny model, so a test
    can act while it runs."""

    def __init__(self, lm, delay: float = 0.02):
        self.lm, self.delay = lm, delay
        self.vocab_size, self.max_length = lm.vocab_size, lm.max_length

    def prefill(self, ids):
        return self.lm.prefill(ids)

    def verify(self, ids):
        time.sleep(self.delay)
        return self.lm.verify(ids)

    def truncate(self, length: int) -> None:
        self.lm.truncate(length)

    @property
    def length(self) -> int:
        return self.lm.length

    def new_sequence(self) -> SlowLM:
        return SlowLM(self.lm.new_sequence(), self.delay)


def slow_engine(engine, delay: float = 0.02):
    """``engine``'s weights and tokenizer behind ``SlowLM``."""
    from quasar_deploy.engine import Engine

    return Engine(SlowLM(engine.lm, delay), engine.tokenizer, engine.stop_ids, engine.backend)
