"""Runs the app under uvicorn with a draining shutdown: on SIGTERM, in-flight requests finish and new ones get 503.

uvicorn's own gives requests a fixed grace period and refuses new connections at once."""

from __future__ import annotations

import gc
import logging
import signal
import threading
import time

import uvicorn
from fastapi import FastAPI

log = logging.getLogger("quasar_deploy.serve")
DRAIN_POLL_S = 0.05
DRAIN_FLUSH_S = 1.0  # once the drain's time is up: for the ended requests' last bytes to go out
GRACEFUL_SHUTDOWN_S = 5  # SIGINT or a second SIGTERM: what uvicorn gives requests in flight before it cancels them


class DrainingServer(uvicorn.Server):
    """First SIGTERM: drain (exit 0 once idle, or end what is in flight with 503 after ``drain_timeout``); else uvicorn's."""

    def __init__(self, config: uvicorn.Config, app: FastAPI, drain_timeout: float):
        super().__init__(config)
        self.app, self.drain_timeout = app, drain_timeout
        self._draining = False

    def handle_exit(self, sig: int, frame) -> None:
        if sig != signal.SIGTERM or self._draining:
            return super().handle_exit(sig, frame)
        self._draining = True
        self.app.state.draining = True
        threading.Thread(target=self._drain, name="quasar-drain", daemon=True).start()

    def _drain(self) -> None:
        state = self.app.state
        log.info("draining: %d request(s) in flight, new ones get 503", state.in_flight())
        deadline = time.monotonic() + self.drain_timeout
        while state.in_flight() and time.monotonic() < deadline:
            time.sleep(DRAIN_POLL_S)
        if state.in_flight():
            log.info("drain timeout: ending %d request(s) with 503", state.in_flight())
            state.end_in_flight()
        self.config.timeout_graceful_shutdown = DRAIN_FLUSH_S  # uvicorn's wait for the connections, which now finish
        self.should_exit = True


def freeze_loaded_objects() -> None:
    """Keep everything loaded so far (garbage collected first) out of the cyclic collector's passes (docs/serving.md)."""
    gc.collect()
    gc.freeze()


def run(app: FastAPI, host: str, port: int, drain_timeout: float = 300.0) -> None:
    """Serve until SIGINT, or SIGTERM and the drain."""
    freeze_loaded_objects()
    config = uvicorn.Config(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
    DrainingServer(config, app, drain_timeout).run()
