"""The HTTP server against the official ``openai`` client and raw HTTP: outputs, concurrency, cancellation, errors."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from quasar_deploy.engine import Engine
from quasar_deploy.serve.app import ServeConfig, create_app

from .serving import chat_engine, live_server, metric, slow_engine

pytest.importorskip("fastapi")

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPTS = [f"def f{i}(x):\n    return x + {i}\n\n\ndef f{i}(" for i in range(8)]
GREEDY = {"temperature": 0, "max_tokens": 12}


@pytest.fixture(scope="module")
def engine(tiny_qwen3) -> Engine:
    return chat_engine(tiny_qwen3)


@pytest.fixture(scope="module")
def server(engine):
    with live_server(create_app(engine, ServeConfig("tiny", api_key=KEY, max_body_bytes=4096))) as base:
        yield base


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=60)


def test_completion_streamed_equals_not_streamed(client, engine):
    full = client.completions.create(model="tiny", prompt=PROMPTS[0], **GREEDY)
    assert full.choices[0].text == engine.generate(PROMPTS[0], max_new_tokens=12).text
    assert full.choices[0].finish_reason in ("stop", "length") and full.usage.completion_tokens <= 12
    chunks = list(client.completions.create(model="tiny", prompt=PROMPTS[0], stream=True, stream_options={"include_usage": True}, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks[:-1]) == full.choices[0].text
    assert chunks[-2].choices[0].finish_reason == full.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage and all(c.usage is None for c in chunks[:-1])


def test_chat_streamed_equals_not_streamed(client, engine):
    messages = [{"role": "user", "content": "def add(a, b):"}]
    full = client.chat.completions.create(model="tiny", messages=messages, **GREEDY)
    assert full.choices[0].message.role == "assistant"
    assert full.choices[0].message.content == engine.generate(messages, max_new_tokens=12).text
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, stream=True, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant" and all(c.usage is None for c in chunks)  # not asked for
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason


def test_eight_concurrent_requests_each_equal_its_solo_output(client, engine):
    """Eight clients at once (half streaming) share batched verify steps; each gets its solo greedy output."""
    alone = [engine.generate(p, max_new_tokens=24).text for p in PROMPTS]

    def complete(i: int) -> str:
        if i % 2:
            chunks = client.completions.create(model="tiny", prompt=PROMPTS[i], temperature=0, max_tokens=24, stream=True)
            return "".join(c.choices[0].text for c in chunks)
        return client.completions.create(model="tiny", prompt=PROMPTS[i], temperature=0, max_tokens=24).choices[0].text

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        texts = list(pool.map(complete, range(len(PROMPTS))))
    assert texts == alone


def test_models_health_and_metrics(client, server):
    assert [m.id for m in client.models.list()] == ["tiny"]
    assert httpx.get(f"{server}/health").json() == {"status": "ok"}  # no key needed
    assert metric(server, "quasar_generation_tokens_total", AUTH) > 0
    assert metric(server, "quasar_acceptance_length_count", AUTH) > 0 and metric(server, "quasar_verify_step_seconds_count", AUTH) > 0
    assert metric(server, "quasar_time_to_first_token_seconds_count", AUTH) > 0
    assert metric(server, 'quasar_requests_total{endpoint="/v1/completions",status="200"}', AUTH) > 0


def test_max_tokens_is_capped_at_the_context_window(client, engine):
    prompt = list(range(1, engine.lm.max_length - 3))
    result = client.completions.create(model="tiny", prompt=prompt, temperature=0, max_tokens=100, extra_body={"draft": "none"})
    assert result.usage.completion_tokens <= 4 and result.usage.prompt_tokens == len(prompt)


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": "other", "prompt": "x"}, 404, "model"),
        ({"model": "tiny", "prompt": "x", "n": 2}, 400, "n"),
        ({"model": "tiny", "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
        ({"model": "tiny", "prompt": "x", "num_draft": 0}, 400, "num_draft"),
        ({"model": "tiny", "prompt": "x", "draft": "model"}, 400, "draft"),
        ({"model": "tiny", "prompt": "x", "adaptive_k": "yes"}, 400, "adaptive_k"),
        ({"model": "tiny", "prompt": "x", "draft": "none", "adaptive_k": True}, 400, "adaptive_k"),
        ({"model": "tiny", "prompt": list(range(600))}, 400, "prompt"),
        ({"model": "tiny", "prompt": ""}, 400, "prompt"),
    ],
)
def test_bad_requests_get_one_line_openai_errors(server, body, status, param):
    response = httpx.post(f"{server}/v1/completions", json=body, headers=AUTH)
    error = response.json()["error"]
    assert response.status_code == status and error["param"] == param and "\n" not in error["message"], error


@pytest.mark.parametrize(
    ("content", "status", "needle"),
    [
        (b'{"model": "tiny", "prompt": "x", "temperature": NaN}', 400, "temperature"),
        (b'{"model": "tiny", "prompt": ', 400, "not valid JSON"),
        (json.dumps({"model": "tiny", "prompt": "x" * 5000}).encode(), 413, "larger than"),
    ],
)
def test_raw_bodies_get_one_line_errors(server, content, status, needle):
    response = httpx.post(f"{server}/v1/completions", content=content, headers={**AUTH, "Content-Type": "application/json"})
    assert response.status_code == status and needle in response.json()["error"]["message"]


def test_missing_or_wrong_api_key_is_401(server):
    for headers in ({}, {"Authorization": "Bearer nope"}):
        for path in ("/v1/models", "/metrics"):
            response = httpx.get(f"{server}{path}", headers=headers)
            assert response.status_code == 401 and response.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{server}/v1/models", headers=AUTH).status_code == 200  # the server survived all of the above


def test_a_disconnect_mid_stream_frees_the_slot(engine):
    """One slot, no queue: a second request is 429 while the first runs; once its client goes, the slot is free again."""
    app = create_app(slow_engine(engine), ServeConfig("tiny", max_sequences=1, max_queue=0))
    with live_server(app) as base:
        long = {"model": "tiny", "prompt": PROMPTS[0], "temperature": 0.7, "seed": 1, "max_tokens": 400, "draft": "none", "stream": True}
        with httpx.stream("POST", f"{base}/v1/completions", json=long, timeout=30) as response:
            assert response.status_code == 200
            lines = response.iter_lines()  # kept: a dropped iterator closes the response, i.e. disconnects
            next(lines)
            busy = httpx.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": "x"})
            assert busy.status_code == 429 and busy.headers["retry-after"] == "1"
            assert metric(base, "quasar_running_sequences") == 1
        deadline = time.monotonic() + 20
        while metric(base, "quasar_running_sequences") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert metric(base, "quasar_running_sequences") == 0 and metric(base, "quasar_queue_depth") == 0
        after = httpx.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 3}, timeout=30)
        assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] >= 1
        assert metric(base, "quasar_generation_tokens_total") < 400  # the cancelled one never finished


def test_the_server_outlives_concurrent_failures(server):
    """Good and bad requests at once: the bad ones fail alone."""
    bad = {"model": "tiny", "prompt": [10**6]}  # a token id outside the vocabulary: refused on the scheduler's thread
    bodies = [{"model": "tiny", "prompt": p, "max_tokens": 4} if i % 2 else bad for i, p in enumerate(PROMPTS)]
    threads_out: list[int] = []
    lock = threading.Lock()

    def post(body):
        status = httpx.post(f"{server}/v1/completions", json=body, headers=AUTH, timeout=60).status_code
        with lock:
            threads_out.append(status)

    with ThreadPoolExecutor(len(bodies)) as pool:
        list(pool.map(post, bodies))
    assert sorted(threads_out) == [200] * 4 + [400] * 4


def test_a_completions_text_is_tokenized_off_the_schedulers_thread(engine, monkeypatch):
    """Encoding a 1 MiB prompt takes seconds: on the scheduler's thread every running sequence waited for it."""
    threads = []
    encode = engine.tokenizer.encode

    def recording(text, *args, **kwargs):
        threads.append(threading.current_thread().name)
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(engine.tokenizer, "encode", recording)
    with live_server(create_app(engine, ServeConfig("tiny", api_key=KEY))) as base:
        for prompt in PROMPTS[:3]:
            response = httpx.post(f"{base}/v1/completions", headers=AUTH, json={"model": "tiny", "prompt": prompt, **GREEDY}, timeout=60)
            assert response.status_code == 200 and response.json()["choices"][0]["text"] == engine.generate(prompt, max_new_tokens=12).text
        lone_surrogate = b'{"model": "tiny", "prompt": "x\\ud800"}'  # JSON's escape: text that cannot be encoded
        bad = httpx.post(f"{base}/v1/completions", headers={**AUTH, "Content-Type": "application/json"}, content=lone_surrogate, timeout=60)
    assert len(threads) >= 3 and "quasar-scheduler" not in threads[:3]
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"
