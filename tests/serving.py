"""Server test helpers: a live server (``quasar_deploy.serve.local``), one metric's value, a slowed-down engine."""

from __future__ import annotations

import time

import httpx

from quasar_deploy.serve.local import free_port, serving_in_thread, wait_healthy

live_server = serving_in_thread
__all__ = ["CHAT_TEMPLATE", "chat_engine", "free_port", "live_server", "metric", "slow_engine", "wait_healthy"]
CHAT_TEMPLATE = "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}\n{% endfor %}<|assistant|>\n"


def chat_engine(model, template_seconds: float | None = None):
    """``model`` on the cpu backend with ``CHAT_TEMPLATE`` (the tiny models' tokenizer has none): the server tests' engine;
    ``template_seconds``: a render's time bound, shorter than the default so that a test of a looping template is short."""
    from quasar_deploy.api import load
    from quasar_deploy.chat.renderer import RENDER_CHARS_PER_TOKEN, ChatRenderer

    engine = load(model, backend="cpu")
    engine.tokenizer.chat_template = CHAT_TEMPLATE
    if template_seconds is not None:
        engine.renderer = ChatRenderer(engine.tokenizer, RENDER_CHARS_PER_TOKEN * engine.lm.max_length, seconds=template_seconds)
    return engine


def metric(base: str, name: str, headers: dict | None = None, default: float | None = None) -> float:
    """One sample's value from /metrics (the first line that starts with ``name``); ``default`` for a labelled sample
    not counted yet (none: it must be there)."""
    text = httpx.get(f"{base}/metrics", headers=headers or {}, timeout=5).text
    values = (line.split()[-1] for line in text.splitlines() if line.startswith(name + " ") or line.startswith(name + "{"))
    value = next(values, default)
    assert value is not None, f"no {name} in /metrics"
    return float(value)


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

    def kv_cache_bytes(self, tokens: int) -> int:
        return self.lm.kv_cache_bytes(tokens)

    def new_sequence(self) -> SlowLM:
        return SlowLM(self.lm.new_sequence(), self.delay)


def slow_engine(engine, delay: float = 0.02):
    """``engine``'s weights and tokenizer behind ``SlowLM``."""
    from quasar_deploy.engine import Engine

    return Engine(SlowLM(engine.lm, delay), engine.tokenizer, engine.stop_ids, engine.backend)
