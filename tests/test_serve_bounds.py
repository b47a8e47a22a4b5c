"""Every request is bounded by the server, and conforms where OpenAI defines the behaviour (regression table, issue 24).

Each class failed before: ``num_draft=1000000`` made one request stall every other stream; 60,000 stop strings
slowed generation 14x; 100,000 nested ``[`` gave a 500 with a RecursionError; ``temperature`` 1e-40 and
``top_p`` 1e-46 passed validation and failed inside sampling (500); streams always carried ``usage``; chat ran
to the context window; nothing ended a request that ran too long, or counted the KV cache at admission; 503
said nothing of when to retry; ``--engine vllm`` ignored our flags and served the model under another name.
"""

from __future__ import annotations

import importlib
import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from click.testing import CliRunner

from quasar_deploy.cli import main
from quasar_deploy.engine import Engine
from quasar_deploy.errors import QuasarError
from quasar_deploy.serve import vllm
from quasar_deploy.serve.app import ServeConfig, create_app
from quasar_deploy.serve.protocol import ApiError, RequestLimits, parse_request
from quasar_deploy.speculative.acceptance import Sampler, SamplingParams

from .helpers import assert_one_line_error
from .serving import CHAT_TEMPLATE, chat_engine, live_server, slow_engine

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402

PROMPT = "def fib(n):\n    if n < 2:\n        return n\n    return fib("


@pytest.fixture(scope="module")
def engine(tiny_qwen3) -> Engine:
    return chat_engine(tiny_qwen3)


@pytest.fixture(scope="module")
def client(engine):
    with TestClient(create_app(engine, ServeConfig("tiny"))) as client:
        yield client


def post(client, body: dict, path: str = "/v1/completions") -> httpx.Response:
    return client.post(path, json={"model": "tiny", **body})


def assert_400(response, param: str | None) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and "\n" not in error["message"]
    if param is not None:
        assert error["param"] == param, error


# --- caps on what one request can ask for ---

TOO_MUCH = [
    ({"num_draft": 17}, "num_draft"),
    ({"num_draft": 1_000_000, "draft": "layerskip"}, "num_draft"),
    ({"num_draft": 2**63}, "num_draft"),
    ({"stop": [f"s{i}" for i in range(17)]}, "stop"),
    ({"stop": "x" * 1025}, "stop"),
    ({"stop": ["ab"] * 60_000}, "stop"),  # the 1 MB body of the review
    ({"stop": ["y" * 600, "z" * 600]}, "stop"),
]


@pytest.mark.parametrize("body, param", TOO_MUCH, ids=range(len(TOO_MUCH)))
def test_what_one_request_may_ask_is_capped(client, body, param):
    assert_400(post(client, {"prompt": PROMPT, **body}), param)


def test_the_caps_are_the_servers_flags(engine):
    limits = RequestLimits(max_num_draft=3, max_stop=1, max_stop_chars=4, default_max_tokens=2)
    with TestClient(create_app(engine, ServeConfig("tiny", num_draft=3, limits=limits))) as client:
        assert_400(post(client, {"prompt": PROMPT, "num_draft": 4}), "num_draft")
        assert_400(post(client, {"prompt": PROMPT, "stop": ["a", "b"]}), "stop")
        assert_400(post(client, {"prompt": PROMPT, "stop": "abcde"}), "stop")
        ok = post(client, {"prompt": PROMPT, "num_draft": 3, "stop": "abcd", "temperature": 0, "max_tokens": 3})
        assert ok.status_code == 200
        chat = post(client, {"messages": [{"role": "user", "content": PROMPT}], "temperature": 0}, "/v1/chat/completions")
        assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] <= 2  # --default-max-tokens
    with pytest.raises(QuasarError, match="--num-draft 5 is above --max-num-draft 3"):
        ServeConfig("tiny", num_draft=5, limits=limits)
    # no --num-draft: a request's drafter's own k (suffix: 16), within --max-num-draft
    with TestClient(create_app(engine, ServeConfig("tiny", limits=limits))) as client:
        ok = post(client, {"prompt": PROMPT, "draft": "suffix", "temperature": 0, "max_tokens": 3})
        assert ok.status_code == 200


def test_chat_without_max_tokens_stops_at_the_default():
    """Before: a chat without max_tokens ran to the context window (2022 tokens on the demo model)."""
    chat = {"messages": [{"role": "user", "content": "x"}]}
    defaults = {"draft": "none", "num_draft": 5, "verify": ("model",)}
    assert parse_request(chat, True, "m", defaults).max_tokens == RequestLimits().default_max_tokens == 1024
    assert parse_request(chat, True, "m", defaults, RequestLimits(default_max_tokens=7)).max_tokens == 7
    assert parse_request({**chat, "max_tokens": 9}, True, "m", defaults).max_tokens == 9
    assert parse_request({"prompt": "x"}, False, "m", defaults).max_tokens == 16  # OpenAI's completions default


def test_a_request_drafts_with_the_servers_k_policy_unless_it_picks_one():
    adaptive = {"draft": "suffix", "num_draft": 5, "adaptive_k": True, "verify": ("model",)}
    options = parse_request({"prompt": "x"}, False, "m", adaptive).options
    assert options["draft"] == "suffix" and options["adaptive_k"] is True
    assert parse_request({"prompt": "x", "adaptive_k": False}, False, "m", adaptive).options["adaptive_k"] is False
    assert "adaptive_k" not in parse_request({"prompt": "x", "draft": "none"}, False, "m", adaptive).options
    with pytest.raises(ApiError, match="adaptive_k needs a drafter"):
        parse_request({"prompt": "x", "draft": "none", "adaptive_k": True}, False, "m", adaptive)


def test_without_a_servers_k_a_request_drafts_up_to_its_drafters_own():
    own = {"draft": "ngram", "num_draft": None, "adaptive_k": False, "verify": ("model",)}
    assert parse_request({"prompt": "x"}, False, "m", own).options["num_draft"] == 5  # the paper's, for ngram
    assert parse_request({"prompt": "x", "draft": "suffix"}, False, "m", own).options["num_draft"] == 16
    capped = RequestLimits(max_num_draft=8)
    assert parse_request({"prompt": "x", "draft": "suffix"}, False, "m", own, capped).options["num_draft"] == 8
    assert parse_request({"prompt": "x", "draft": "suffix", "num_draft": 3}, False, "m", own).options["num_draft"] == 3


def test_a_request_picks_a_verify_mode_the_server_offers():
    plain, exact = {"draft": "none", "num_draft": 5, "verify": ("model",)}, {"draft": "none", "num_draft": 5, "verify": ("exact", "model")}
    assert parse_request({"prompt": "x"}, False, "m", plain).options["verify"] == "model"
    assert parse_request({"prompt": "x"}, False, "m", exact).options["verify"] == "exact"  # the server's default
    assert parse_request({"prompt": "x", "verify": "model"}, False, "m", exact).options["verify"] == "model"
    with pytest.raises(ApiError, match=r"verify must be one of model on this server, got 'exact' \(exact mode needs a server started"):
        parse_request({"prompt": "x", "verify": "exact"}, False, "m", plain)
    with pytest.raises(ApiError, match="verify must be one of exact, model on this server, got 3"):
        parse_request({"prompt": "x", "verify": 3}, False, "m", exact)


# --- JSON the parser must not choke on ---

DEEP = [
    b"[" * 100_000,
    b'{"model": "tiny", "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    json.dumps({"model": "tiny", "prompt": "x", "user": json.loads("[" * 40 + "]" * 40)}).encode(),
    b'{"model": "tiny", "messages": [{"role": "user", "content": ' + b'{"a": ' * 50 + b"1" + b"}" * 50 + b"}]}",
]


@pytest.mark.parametrize("content", DEEP, ids=range(len(DEEP)))
def test_deeply_nested_json_is_400_not_500(client, content):
    response = client.post("/v1/chat/completions", content=content, headers={"Content-Type": "application/json"})
    assert_400(response, None)
    assert "nested deeper than" in response.json()["error"]["message"]


# --- sampling parameters that cannot give finite probabilities ---


@pytest.mark.parametrize("temperature", [1e-40, 5e-324, 1e-6, 2.2e-308])
def test_a_temperature_too_small_for_float32_is_400(client, temperature):
    for stream in (False, True):
        assert_400(post(client, {"prompt": PROMPT, "temperature": temperature, "stream": stream}), "temperature")
    with pytest.raises(QuasarError, match="temperature must be 0 \\(greedy\\) or at least"):
        SamplingParams(temperature=temperature)


@pytest.mark.parametrize("top_p", [1e-46, 5e-324, 1e-30, 1e-8])
def test_a_tiny_top_p_keeps_the_top_token(client, engine, top_p):
    """Documented clamp (Hugging Face's too): top-p keeps at least the most probable token, so the output is greedy's."""
    greedy = engine.generate(PROMPT, max_new_tokens=8, draft="none").text
    body = {"prompt": PROMPT, "temperature": 1.0, "top_p": top_p, "seed": 3, "max_tokens": 8, "draft": "none"}
    response = post(client, body)
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == greedy
    with client.stream("POST", "/v1/completions", json={"model": "tiny", **body, "stream": True}) as streamed:
        lines = [line for line in streamed.iter_lines() if line.startswith("data: ")]
    assert streamed.status_code == 200 and lines[-1] == "data: [DONE]" and '"error"' not in "".join(lines)
    probs = Sampler(SamplingParams(1.0, 0, top_p), seed=0).distribution(torch_logits())
    assert probs.isfinite().all() and probs.max() == 1


def torch_logits():
    import torch

    return torch.tensor([[3.0, 2.9, -1.0, 0.5]])


# --- stream_options.include_usage, as OpenAI defines it ---


def sse_chunks(client, body: dict, path: str = "/v1/completions") -> list[dict]:
    with client.stream("POST", path, json={"model": "tiny", "stream": True, **body}) as response:
        assert response.status_code == 200
        return [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_usage_chunk_only_when_asked(client, path):
    base = {"messages": [{"role": "user", "content": PROMPT}]} if "chat" in path else {"prompt": PROMPT}
    base = {**base, "temperature": 0, "max_tokens": 6}
    plain = sse_chunks(client, base, path)
    assert all("usage" not in c for c in plain) and plain[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    for options in ({"include_usage": False}, {}):
        assert all("usage" not in c for c in sse_chunks(client, {**base, "stream_options": options}, path))
    asked = sse_chunks(client, {**base, "stream_options": {"include_usage": True}}, path)
    assert all(c["usage"] is None and len(c["choices"]) == 1 for c in asked[:-1])
    assert asked[-1]["choices"] == [] and asked[-1]["usage"]["completion_tokens"] >= 1 and asked[-1]["id"] == asked[0]["id"]
    full = post(client, base, path).json()
    assert asked[-1]["usage"] == full["usage"]


@pytest.mark.parametrize("options", [{"include_usage": "yes"}, [True], "include_usage"])
def test_bad_stream_options_are_400(client, options):
    assert_400(post(client, {"prompt": PROMPT, "stream": True, "stream_options": options}), "stream_options")


def test_stream_options_without_stream_is_400(client):
    assert_400(post(client, {"prompt": PROMPT, "stream_options": {"include_usage": True}}), "stream_options")


# --- the deadline, KV-cache admission, and when to retry ---


def test_a_request_past_the_deadline_ends_with_504(engine):
    app = create_app(slow_engine(engine, delay=0.05), ServeConfig("tiny", request_timeout=0.5))
    body = {"model": "tiny", "prompt": PROMPT, "temperature": 0, "max_tokens": 400, "draft": "none"}
    with live_server(app) as base:
        began = time.monotonic()
        response = httpx.post(f"{base}/v1/completions", json=body, timeout=30)
        assert response.status_code == 504 and "limit of 0.5 s" in response.json()["error"]["message"]
        assert time.monotonic() - began < 5
        with httpx.stream("POST", f"{base}/v1/completions", json={**body, "stream": True}, timeout=30) as streamed:
            lines = list(streamed.iter_lines())
        assert any('"code": "timeout"' in line for line in lines) and "data: [DONE]" in lines
        short = httpx.post(f"{base}/v1/completions", json={**body, "max_tokens": 2}, timeout=30)
        assert short.status_code == 200  # the slot was freed


def test_a_body_that_does_not_arrive_is_408(engine):
    """A client trickling its body would hold a connection (and a handler) for as long as it likes."""
    import socket

    with live_server(create_app(engine, ServeConfig("tiny", body_timeout=0.5))) as base:
        host, port = base.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
            sock.sendall(head.encode() + b'{"model": ')
            began = time.monotonic()
            answer = sock.recv(4096).decode()
            while not answer.endswith("}"):  # the body may come in a packet of its own
                answer += sock.recv(4096).decode()
        assert answer.startswith("HTTP/1.1 408") and "did not arrive within 0.5 s" in answer and time.monotonic() - began < 5
        assert httpx.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 2}).status_code == 200


def test_kv_cache_is_counted_at_admission(engine):
    """A request reserves the KV cache its prompt and max_tokens can grow to: 429 while that does not fit beside the
    running ones' reservations, 400 if it never could."""
    small, large = engine.lm.kv_cache_bytes(1), engine.lm.kv_cache_bytes(400)  # up to 256 tokens, and up to 512
    assert small < large
    body = {"model": "tiny", "prompt": PROMPT, "temperature": 0, "max_tokens": 300, "draft": "none"}  # ~320 tokens: large
    with TestClient(create_app(engine, ServeConfig("tiny", kv_cache_bytes=large - 1))) as client:
        never = client.post("/v1/completions", json=body)
        assert_400(never, "max_tokens")
        assert "MiB of KV cache" in never.json()["error"]["message"]
        assert client.post("/v1/completions", json={**body, "max_tokens": 2}).status_code == 200
    app = create_app(slow_engine(engine, delay=0.01), ServeConfig("tiny", kv_cache_bytes=large + small))
    with live_server(app) as base:
        with httpx.stream("POST", f"{base}/v1/completions", json={**body, "stream": True}, timeout=30) as first:
            assert first.status_code == 200
            lines = first.iter_lines()
            next(lines)
            second = httpx.post(f"{base}/v1/completions", json=body, timeout=30)
            assert second.status_code == 429 and second.headers["retry-after"] == "1" and "KV cache is full" in second.text
            assert httpx.post(f"{base}/v1/completions", json={**body, "max_tokens": 2}, timeout=30).status_code == 200  # fits
            list(lines)
        with httpx.stream("POST", f"{base}/v1/completions", json={**body, "stream": True}, timeout=30) as again:
            assert again.status_code == 200  # admitted: the first one's reservation left with it


def test_503_says_when_to_retry(engine):
    app = create_app(engine, ServeConfig("tiny"))
    with TestClient(app) as client:
        app.state.draining = True
        for response in (post(client, {"prompt": PROMPT}), client.get("/health")):
            assert response.status_code == 503 and response.headers["retry-after"] == "1"


def test_queue_full_is_429_with_retry_after(engine):
    app = create_app(slow_engine(engine, delay=0.05), ServeConfig("tiny", max_sequences=1, max_queue=0))
    body = {"model": "tiny", "prompt": PROMPT, "temperature": 0, "max_tokens": 60, "draft": "none"}
    with live_server(app) as base, ThreadPoolExecutor(3) as pool:
        statuses = list(pool.map(lambda _: httpx.post(f"{base}/v1/completions", json=body, timeout=60), range(3)))
    refused = [r for r in statuses if r.status_code == 429]
    assert refused and all(r.headers["retry-after"] == "1" for r in refused)


# --- --engine vllm: the same name, no silently ignored flag, explicit pass-through ---


@pytest.fixture
def vllm_argv(monkeypatch):
    calls = []
    serve_cli = importlib.import_module("quasar_deploy.cli.serve")  # where serve_with_vllm finds exec_vllm
    monkeypatch.setattr(serve_cli, "exec_vllm", lambda argv, env: calls.append((argv, env)))
    return calls


def test_vllm_serves_under_our_engines_name(tmp_path, vllm_argv):
    model = tmp_path / "w8a8"
    model.mkdir()
    result = CliRunner().invoke(main, ["serve", str(model), "--engine", "vllm"])
    assert result.exit_code == 0, result.output
    argv, _ = vllm_argv[0]
    assert argv[argv.index("--served-model-name") + 1] == vllm.served_name(model) == "w8a8"
    assert "--max-num-seqs" not in argv and "--chat-template" not in argv  # vLLM's own defaults unless given
    CliRunner().invoke(main, ["serve", str(model), "--engine", "vllm", "--model-name", "m"])
    assert vllm_argv[1][0][vllm_argv[1][0].index("--served-model-name") + 1] == "m"


def test_vllm_gets_the_flags_it_has_and_extra_arguments(tmp_path, vllm_argv):
    template = tmp_path / "t.jinja"
    template.write_text(CHAT_TEMPLATE)
    args = ["serve", str(tmp_path), "--engine", "vllm", "--max-sequences", "3", "--chat-template", str(template)]
    args += ["--vllm-arg=--max-model-len", "--vllm-arg", "4096", "--vllm-arg=--gpu-memory-utilization=0.8"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    argv, _ = vllm_argv[0]
    assert argv[argv.index("--max-num-seqs") + 1] == "3" and argv[argv.index("--chat-template") + 1] == str(template)
    assert argv[-3:] == ["--max-model-len", "4096", "--gpu-memory-utilization=0.8"]


VLLM_REFUSED = [
    ["--max-queue", "4"],
    ["--max-body-bytes", "100"],
    ["--drain-timeout", "1"],
    ["--backend", "cpu"],
    ["--provider", "cpu"],
    ["--max-num-draft", "8"],
    ["--max-stop", "2"],
    ["--max-stop-chars", "20"],
    ["--default-max-tokens", "64"],
    ["--request-timeout", "30"],
    ["--body-timeout", "5"],
    ["--kv-cache-mib", "100"],
    ["--prefill-tokens", "512"],
    ["--adaptive-k"],
]


@pytest.mark.parametrize("flag", VLLM_REFUSED, ids=[f[0] for f in VLLM_REFUSED])
def test_flags_vllm_cannot_honour_are_refused(tmp_path, vllm_argv, flag):
    result = CliRunner().invoke(main, ["serve", str(tmp_path), "--engine", "vllm", *flag])
    assert_one_line_error(result, f"{flag[0]} has no vLLM counterpart", only_line=True)
    assert vllm_argv == []


@pytest.mark.parametrize("flag", [["--vllm-arg", "--x"], ["--tensor-parallel-size", "2"]])
def test_vllm_only_flags_are_refused_for_our_engine(tmp_path, flag):
    result = CliRunner().invoke(main, ["serve", str(tmp_path), *flag])
    assert_one_line_error(result, "applies to --engine vllm only", only_line=True)


def test_the_prefill_budget_reaches_the_scheduler(engine, monkeypatch):
    """``serve --prefill-tokens`` sets the prompt tokens a round prefills (tests/test_batching.py: the budget's effect)."""
    serve_cli = importlib.import_module("quasar_deploy.cli.serve")  # the module (the package's ``serve`` is the command)
    made = {}
    monkeypatch.setattr(serve_cli, "load_engine", lambda *args: engine)
    monkeypatch.setattr("quasar_deploy.serve.server.run", lambda app, *args: made.setdefault("app", app))
    result = CliRunner().invoke(main, ["serve", "unused", "--prefill-tokens", "48", "--kv-cache-mib", "64"])
    assert result.exit_code == 0, result.output
    assert made["app"].state.scheduler.prefill_tokens == 48
    assert create_app(engine, ServeConfig("tiny")).state.scheduler.prefill_tokens == 256  # the default
    refused = CliRunner().invoke(main, ["serve", "unused", "--prefill-tokens", "0"])
    assert refused.exit_code == 2 and "'--prefill-tokens'" in refused.output and "Traceback" not in refused.output


def test_a_default_num_draft_above_the_cap_fails_before_loading(tmp_path):
    result = CliRunner().invoke(main, ["serve", str(tmp_path / "nothing-here"), "--num-draft", "20"])
    assert_one_line_error(result, "--num-draft 20 is above --max-num-draft 16", only_line=True)
