"""Property-based requests against the app in-process: whatever a client sends, and whatever the model's chat template
does, the answer is a JSON 2xx or 4xx, never a 5xx, within the template's time bound, and the server still answers the
same greedy completion afterwards.

Bounded for the suite (``QUASAR_FUZZ_EXAMPLES`` examples per test, 40 by default, a few seconds); a longer run
raises it: ``QUASAR_FUZZ_EXAMPLES=5000 pytest tests/test_serve_fuzz.py`` (docs/security.md).
"""

from __future__ import annotations

import json
import os
import time

import pytest

from quasar_deploy.engine import Engine
from quasar_deploy.serve.app import ServeConfig, create_app
from quasar_deploy.serve.protocol import RequestLimits

pytest.importorskip("fastapi")
hypothesis = pytest.importorskip("hypothesis")
from fastapi.testclient import TestClient  # noqa: E402
from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from .serving import CHAT_TEMPLATE, chat_engine  # noqa: E402

EXAMPLES = int(os.environ.get("QUASAR_FUZZ_EXAMPLES", "40"))
TEMPLATE_SECONDS = 0.5  # the renders' time bound here: a looping template costs an example no more
FUZZ = settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
PROMPT = "def add(a, b):\n    return"
GREEDY = {"model": "tiny", "prompt": PROMPT, "temperature": 0, "max_tokens": 8, "draft": "none"}

# any JSON value, a little nested
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([0, 1, -1, 0.0, 1e-40, 5e-324, 1e-46, 2, 2.0000001, 2**63, 2**64]),
    st.text(max_size=20),
    st.sampled_from(["", "\ud800", "none", "ngram", "layerskip", "model", "tiny", "\x00", "a" * 300]),
)
values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=8
)
small_ints = st.one_of(st.integers(-3, 8), values)
messages = st.one_of(
    values,
    st.lists(
        st.fixed_dictionaries(
            {
                "role": st.one_of(st.sampled_from(["user", "system", "assistant"]), values),
                "content": st.one_of(st.text(max_size=40), values),
            }
        ),
        max_size=3,
    ),
)
prompts = st.one_of(st.text(max_size=60), st.lists(st.integers(-5, 2000), max_size=20), values)
FIELDS = {
    "model": st.one_of(st.just("tiny"), values),
    "max_tokens": small_ints,
    "max_completion_tokens": small_ints,
    "temperature": values,
    "top_p": values,
    "top_k": st.one_of(st.integers(-2, 50), values),
    "seed": values,
    "stop": st.one_of(st.text(max_size=5), st.lists(st.text(max_size=5), max_size=20), values),
    "draft": st.one_of(st.sampled_from(["none", "ngram", "layerskip", "model"]), values),
    "num_draft": small_ints,
    "stream": st.one_of(st.booleans(), values),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.one_of(st.booleans(), values)}), values),
    "n": values,
    "logprobs": values,
    "user": values,
}


# chat templates, as a model directory from elsewhere could carry them: pieces that render, refuse, loop, recurse, build
# large strings or reach for what the sandbox keeps out, some sized by a number (@N@)
TEMPLATE_PIECES = [
    CHAT_TEMPLATE,
    "{{ bos_token }}{{ eos_token }}",
    "{% if add_generation_prompt %}<|assistant|>{% endif %}",
    "{{ raise_exception('not this conversation') }}",
    "{{ messages | tojson }}",
    "{{ undefined_thing.attribute }}",
    "{{ 1 / 0 }}",
    "{% for %}",
    "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ strftime_now('%Y') }}",
    "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
]
SIZED_PIECES = [
    "{{ messages[@N@].content }}",
    "{{ 'ab ' * @N@ }}",
    "{{ 'x'.ljust(@N@) }}",
    "{{ range(@N@) | join(',') }}",
    "{% for i in range(@N@) %}{% for j in range(@N@) %}x{% endfor %}{% endfor %}",
    "{{ messages[0].content * @N@ }}",
    "{{ 'z' | center(@N@) }}",
    "{{ 'w\nv' | indent(@N@) }}",
]
sizes = st.sampled_from([-1, 0, 1, 3, 1000, 100_000, 10**9])
templates = st.lists(
    st.one_of(
        st.sampled_from(TEMPLATE_PIECES),
        st.builds(lambda piece, n: piece.replace("@N@", str(n)), st.sampled_from(SIZED_PIECES), sizes),
        st.text(max_size=20),
    ),
    min_size=1,
    max_size=4,
).map("".join)
USER = {"role": "user", "content": "hi"}
roles = st.sampled_from(["user", "system", "assistant"])
conversations = st.lists(st.fixed_dictionaries({"role": roles, "content": st.text(max_size=40)}), min_size=1, max_size=3)


def bodies(chat: bool):
    required = {"messages": messages} if chat else {"prompt": prompts}
    return st.fixed_dictionaries(required, optional={**FIELDS, **{k: values for k in ("extra", "best_of", "echo")}})


@pytest.fixture(scope="module")
def engine(tiny_qwen3) -> Engine:
    return chat_engine(tiny_qwen3, template_seconds=TEMPLATE_SECONDS)


@pytest.fixture(scope="module")
def client(engine):
    # small bounds, so that every valid example is quick: the fuzz is after the parser and the bounds, not throughput
    config = ServeConfig("tiny", max_body_bytes=1 << 16, num_draft=4, limits=RequestLimits(max_num_draft=8, default_max_tokens=8))
    with TestClient(create_app(engine, config), raise_server_exceptions=False) as client:
        before = client.post("/v1/completions", json=GREEDY).json()["choices"][0]["text"]
        yield client
        assert client.post("/v1/completions", json=GREEDY).json()["choices"][0]["text"] == before  # same greedy output after


def check(response) -> None:
    """A 2xx or 4xx, with a JSON body (a stream: JSON events, none of them a server error)."""
    assert response.status_code < 500, response.text
    if response.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", response.text
        parsed = [json.loads(event) for event in events[:-1]]
        assert not any(e.get("error", {}).get("type") == "server_error" for e in parsed), response.text
    else:
        body = response.json()
        assert response.status_code < 300 or "error" in body and "\n" not in body["error"]["message"]


def send(client, path: str, body: dict):
    """``body`` as JSON text with escapes (``\\ud800`` reaches the server as JSON allows it, where a client's UTF-8 would fail)."""
    return client.post(path, content=json.dumps(capped(body)).encode(), headers={"Content-Type": "application/json"})


def capped(body: dict) -> dict:
    """Valid large max_tokens would only make an example slow: the bounds under test are the server's."""
    for name in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(name), int) and not isinstance(body[name], bool) and body[name] > 8:
            body[name] = 8
    return body


@FUZZ
@given(body=bodies(chat=False))
def test_completions_never_5xx(client, body):
    check(send(client, "/v1/completions", body))


@FUZZ
@given(body=bodies(chat=True))
def test_chat_never_5xx(client, body):
    check(send(client, "/v1/chat/completions", body))


@FUZZ
@given(raw=st.one_of(st.binary(max_size=200), st.text(max_size=200).map(str.encode), st.integers(0, 3000).map(lambda n: b"[" * n)))
def test_raw_bodies_never_5xx(client, raw):
    for path in ("/v1/completions", "/v1/chat/completions"):
        check(client.post(path, content=raw, headers={"Content-Type": "application/json"}))


@FUZZ
@given(template=templates, messages=conversations)
@example(template="{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}", messages=[USER])  # issue 44
@example(template="{{ 'ab ' * 5000000 }}{{ messages[0].content }}", messages=[USER])  # issue 44: 20 s and 1.4 GB before
def test_chat_templates_never_5xx_nor_run_past_their_bound(client, engine, template, messages):
    engine.tokenizer.chat_template = template
    try:
        began = time.monotonic()
        check(send(client, "/v1/chat/completions", {"model": "tiny", "messages": messages, "max_tokens": 4}))
        assert time.monotonic() - began < TEMPLATE_SECONDS + 10  # a render's bound, then the tiny generation at most
        assert engine.renderer.busy == 0
    finally:
        engine.tokenizer.chat_template = CHAT_TEMPLATE
