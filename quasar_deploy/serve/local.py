"""The server on this machine, for benchmarks and tests: on a free 127.0.0.1 port, in a thread, ready when /health answers."""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import uvicorn
from fastapi import FastAPI

START_TIMEOUT_S = 30


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(base: str, timeout: float = START_TIMEOUT_S, process: subprocess.Popen | None = None) -> None:
    """Until /health answers 200; a server ``process`` that exits meanwhile fails at once, with its stderr."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            output = process.stderr.read().decode()[-2000:] if process.stderr else "(its output went elsewhere)"
            raise RuntimeError(f"the server exited with {process.returncode}: {output}")
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"no server answered at {base} within {timeout} s")


@contextmanager
def serving_in_thread(app: FastAPI) -> Iterator[str]:
    """The base URL (``http://127.0.0.1:PORT``) of ``app`` served by uvicorn in a thread, stopped on exit."""
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
