"""What one client, or one model directory's chat template, can do to everyone else on the server (issue 44).

Each attack runs against a live server; meanwhile a plain completion must take at most 3x its time alone, and
afterwards the server's memory (its process and the chat renderer's) must be back within 10% of where it was.
Each class failed before: a chat template that loops rendered on the scheduler's thread (three chats stalled a plain
completion for 15 s); one that builds a 15 MB string passed the 5 s bound, and tokenizing it took 20 s and 1.4 GB that
the server kept; non-streaming clients that gave up kept their slots generating (a plain request waited 31 s) and were
counted as 200; a client gone while sending its body was a 500 with a traceback.
"""

from __future__ import annotations

import logging
import socket
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from quasar_deploy.engine import Engine
from quasar_deploy.memory import tree_resident_mib
from quasar_deploy.serve.app import ServeConfig, create_app

from .serving import chat_engine, live_server, metric

pytest.importorskip("fastapi")

TEMPLATE_SECONDS = 1.0
ALONE = 5  # plain completions timed before an attack
PLAIN = {"model": "tiny", "prompt": "def f(x):\n", "temperature": 0, "max_tokens": 64, "draft": "none"}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "def f(x):"}], "max_tokens": 4}
LONG = {"model": "tiny", "prompt": "def g(x):\n", "temperature": 0, "max_tokens": 400, "draft": "none"}
TEMPLATES = {
    "nested loops": "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
    "loops over the messages": "{% for m in messages %}{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}"
    "{% endfor %}{{ m }}",
    "a string multiplied": "{{ 'ab ' * 5000000 }}{{ messages[0].content }}",
    "a message multiplied": "{{ messages[0].content * 2000000 }}",
    "a padded string": "{{ 'a'.ljust(10**9) }}",
    "a string doubled": "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
}


@pytest.fixture(scope="module")
def engine(tiny_qwen3) -> Engine:
    return chat_engine(tiny_qwen3, template_seconds=TEMPLATE_SECONDS)


@pytest.fixture(scope="module")
def server(engine):
    with live_server(create_app(engine, ServeConfig("tiny"))) as base:
        yield base


def plain(base: str) -> float:
    began = time.monotonic()
    response = httpx.post(f"{base}/v1/completions", json=PLAIN, timeout=120)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 64, response.text
    return time.monotonic() - began


def idle(base: str, engine: Engine) -> None:
    """Until no sequence runs or waits and no render is in flight (bounded)."""
    deadline = time.monotonic() + 30
    while (metric(base, "quasar_running_sequences") or metric(base, "quasar_queue_depth") or engine.renderer.busy) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.05)


def withstands(base: str, engine: Engine, attack: Callable[[], None], *, probe_during: bool = True, probe_after_s: float = 0.0) -> int:
    """``attack`` (in a thread) slows no plain completion sent while it goes on (``probe_during``) or for
    ``probe_after_s`` seconds once it has ended past 3x its time alone, and leaves the memory as it was; the number of
    plain completions it took."""
    alone = statistics.median(plain(base) for _ in range(ALONE))
    before = tree_resident_mib()
    during: list[float] = []
    with ThreadPoolExecutor(1) as pool:
        attacker = pool.submit(attack)
        while probe_during and not attacker.done():
            during.append(plain(base))
        attacker.result()  # its own assertions
    ended = time.monotonic()
    while time.monotonic() - ended < probe_after_s:
        during.append(plain(base))
    assert during and max(during) <= 3 * alone, (alone, during)
    idle(base, engine)
    deadline = time.monotonic() + 10  # a reaped render's pages may take the kernel a moment
    while tree_resident_mib() > 1.1 * before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert tree_resident_mib() <= 1.1 * before, (before, tree_resident_mib())
    return ALONE + len(during)


def chats(base: str, n: int) -> list[httpx.Response]:
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda _: httpx.post(f"{base}/v1/chat/completions", json=CHAT, timeout=120), range(n)))


@pytest.mark.parametrize("name", TEMPLATES)
def test_a_runaway_chat_template_holds_no_other_request(server, engine, name, monkeypatch):
    """Three chats at once against the template: each refused in one line, off the scheduler's thread."""
    plain(server)
    assert chats(server, 1)[0].status_code == 200  # the renderer's process runs: its start is not the attack's
    monkeypatch.setattr(engine.tokenizer, "chat_template", TEMPLATES[name])
    refused: list[httpx.Response] = []
    withstands(server, engine, lambda: refused.extend(chats(server, 3)))
    for response in refused:
        error = response.json()["error"]
        assert response.status_code == 400 and error["param"] == "messages" and "\n" not in error["message"], response.text
        assert "chat template" in error["message"], error


def give_up(base: str) -> None:
    """A long completion whose client stops waiting after half a second."""
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{base}/v1/completions", json=LONG, timeout=0.5)


def drop_stream(base: str) -> None:
    """A long stream whose client goes after its first chunk."""
    with httpx.stream("POST", f"{base}/v1/completions", json={**LONG, "stream": True}, timeout=30) as response:
        next(response.iter_lines())


@pytest.mark.parametrize("leave", [give_up, drop_stream], ids=["not streamed", "streamed"])
def test_clients_that_go_free_their_slots_at_once(server, engine, leave):
    """Eight long completions whose clients go: their sequences end at the next step, never finish, and count as 499."""
    gone = metric(server, 'quasar_requests_total{endpoint="/v1/completions",status="499"}', default=0)

    def attack() -> None:
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(leave, [server] * 8))
        deadline = time.monotonic() + 1
        while metric(server, "quasar_running_sequences") and time.monotonic() < deadline:
            time.sleep(0.02)
        assert metric(server, "quasar_running_sequences") == 0

    tokens = metric(server, "quasar_generation_tokens_total")
    plains = withstands(server, engine, attack, probe_during=False, probe_after_s=2)  # the 8 ran until their clients went
    assert metric(server, 'quasar_requests_total{endpoint="/v1/completions",status="499"}') == gone + 8
    assert metric(server, "quasar_generation_tokens_total") == tokens + PLAIN["max_tokens"] * plains  # none of the 8 finished


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_a_client_gone_while_sending_its_body_is_a_disconnect_not_a_500(server, engine):
    """Bodies cut off halfway, on both routes: counted as 499, no traceback logged, and nobody else slowed."""
    statuses = ("499", "500")
    paths = ("/v1/completions", "/v1/chat/completions")
    counts = {(p, s): metric(server, f'quasar_requests_total{{endpoint="{p}",status="{s}"}}', default=0) for p in paths for s in statuses}
    host, port = server.removeprefix("http://").split(":")
    logged = Records()
    logging.getLogger("uvicorn.error").addHandler(logged)

    def cut(path: str) -> None:
        with socket.create_connection((host, int(port)), timeout=5) as connection:
            head = f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
            connection.sendall(head.encode() + b'{"model": "tiny", "prompt": ')
            time.sleep(0.1)

    def attack() -> None:
        for path in paths * 4:
            cut(path)
        deadline = time.monotonic() + 5
        while metric(server, 'quasar_requests_total{endpoint="/v1/chat/completions",status="499"}', default=0) < counts[
            (paths[1], "499")
        ] + 4 and (time.monotonic() < deadline):
            time.sleep(0.05)

    try:
        withstands(server, engine, attack)
    finally:
        logging.getLogger("uvicorn.error").removeHandler(logged)
    for path in paths:
        assert metric(server, f'quasar_requests_total{{endpoint="{path}",status="499"}}', default=0) == counts[(path, "499")] + 4
        assert metric(server, f'quasar_requests_total{{endpoint="{path}",status="500"}}', default=0) == counts[(path, "500")]
    assert not [r for r in logged.records if r.exc_info], [r.getMessage() for r in logged.records]


def test_a_chat_whose_client_goes_while_its_template_renders_is_not_rendered_on(tiny_qwen3):
    """The render is killed when its client goes, not at its time bound."""
    engine = chat_engine(tiny_qwen3, template_seconds=60)
    engine.tokenizer.chat_template = TEMPLATES["nested loops"]
    try:
        with live_server(create_app(engine, ServeConfig("tiny"))) as base:
            for _ in range(3):
                with pytest.raises(httpx.ReadTimeout):
                    httpx.post(f"{base}/v1/chat/completions", json=CHAT, timeout=1)
                deadline = time.monotonic() + 2
                while engine.renderer.busy and time.monotonic() < deadline:
                    time.sleep(0.02)
                assert engine.renderer.busy == 0
            assert metric(base, 'quasar_requests_total{endpoint="/v1/chat/completions",status="499"}') == 3
    finally:
        engine.renderer.close()
