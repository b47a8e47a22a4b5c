"""The server as a process: SIGTERM drains (in-flight requests finish, new ones get 503, exit code 0); `--engine vllm`."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from quasar_deploy.errors import QuasarError
from quasar_deploy.serve.vllm import exec_vllm, vllm_command

from .helpers import assert_one_line_error
from .serving import CHAT_TEMPLATE, free_port, wait_healthy

ROOT = Path(__file__).resolve().parent.parent
# the server on MODEL at PORT with --drain-timeout SECONDS and the chat template TEMPLATE, a verify step taking 50 ms
SERVER_SCRIPT = """
import sys
from quasar_deploy.api import load
from quasar_deploy.serve.app import ServeConfig, create_app
from quasar_deploy.serve.server import run
from tests.serving import slow_engine

model, port, drain_timeout, template = sys.argv[1:]
engine = slow_engine(load(model, backend="cpu"), delay=0.05)
engine.tokenizer.chat_template = template
run(create_app(engine, ServeConfig("tiny")), "127.0.0.1", int(port), drain_timeout=float(drain_timeout))
"""
LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}"
LONG = {"model": "tiny", "prompt": "def f0(x):\n", "temperature": 0, "max_tokens": 400, "draft": "none"}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "def f(x):"}]}


def start_server(model: Path, drain_timeout: float, template: str = CHAT_TEMPLATE) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [sys.executable, "-c", SERVER_SCRIPT, str(model), str(port), str(drain_timeout), template]
    process = subprocess.Popen(command, cwd=ROOT, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    wait_healthy(base, timeout=120, process=process)
    return process, base


def test_sigterm_drains_in_flight_requests_and_refuses_new_ones(tiny_qwen3):
    pytest.importorskip("fastapi")
    process, base = start_server(tiny_qwen3, drain_timeout=60)
    try:
        lines: list[str] = []
        first = threading.Event()

        def stream() -> None:
            body = {"model": "tiny", "prompt": "def f0(x):\n", "temperature": 0.7, "seed": 1, "max_tokens": 40, "draft": "none"}
            with httpx.stream("POST", f"{base}/v1/completions", json={**body, "stream": True}, timeout=60) as response:
                for line in response.iter_lines():
                    lines.append(line)
                    first.set()

        client = threading.Thread(target=stream)
        client.start()
        assert first.wait(30)
        process.send_signal(signal.SIGTERM)
        statuses = set()
        for _ in range(50):  # bounded: the flag is set as soon as the signal is handled
            statuses.add(httpx.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": "x"}, timeout=10).status_code)
            if 503 in statuses:
                break
        assert 503 in statuses and httpx.get(f"{base}/health").status_code == 503
        client.join(60)
        data = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        assert lines[-2:] == ["data: [DONE]", ""] or lines[-1] == "data: [DONE]"
        assert data[-1]["choices"][0]["finish_reason"] in ("stop", "length") and "usage" not in data[-1]
        assert process.wait(60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_the_drain_timeout_is_honoured_and_the_requests_it_ends_get_an_answer(tiny_qwen3):
    """``--drain-timeout 2`` with a stream, a plain completion and a chat whose template loops in flight: the process
    exits 2 s after SIGTERM (not 5 s later, at uvicorn's own grace period), the stream ends with an error event and
    ``[DONE]``, the others get 503."""
    pytest.importorskip("fastapi")
    process, base = start_server(tiny_qwen3, drain_timeout=2, template=LOOP)
    try:
        lines: list[str] = []
        answers: dict[str, httpx.Response] = {}
        first = threading.Event()

        def stream() -> None:
            with httpx.stream("POST", f"{base}/v1/completions", json={**LONG, "stream": True}, timeout=60) as response:
                for line in response.iter_lines():
                    lines.append(line)
                    first.set()

        def post(name: str, path: str, body: dict) -> None:
            answers[name] = httpx.post(f"{base}{path}", json=body, timeout=60)

        clients = [
            threading.Thread(target=stream),
            threading.Thread(target=post, args=("plain", "/v1/completions", LONG)),
            threading.Thread(target=post, args=("chat", "/v1/chat/completions", CHAT)),
        ]
        for client in clients[:2]:
            client.start()
        assert first.wait(30)
        clients[2].start()  # the chat only now: on a loaded machine its render could reach its own time bound first
        time.sleep(0.5)  # the plain completion is generating, the chat's template rendering
        began = time.monotonic()
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
        assert 2 <= time.monotonic() - began < 3.5
        for client in clients:
            client.join(30)
        data = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
        assert data[-1] == "[DONE]" and json.loads(data[-2])["error"]["message"] == "the server is shutting down", lines[-3:]
        for name in ("plain", "chat"):
            assert answers[name].status_code == 503 and answers[name].json()["error"]["message"] == "the server is shutting down"
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_vllm_command_for_a_checkpoint(tmp_path):
    argv, env = vllm_command(tmp_path, "127.0.0.1", 8000, api_key="k", model_name="m", tensor_parallel_size=2)
    assert argv[:3] == ["vllm", "serve", str(tmp_path)] and "--quantization" not in argv
    assert argv[argv.index("--host") + 1] == "127.0.0.1" and argv[argv.index("--port") + 1] == "8000"
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2" and argv[argv.index("--served-model-name") + 1] == "m"
    config = json.loads(argv[argv.index("--speculative-config") + 1])
    assert config == {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    assert env == {"VLLM_API_KEY": "k"} and "k" not in argv  # the key stays out of the process list


def test_vllm_command_for_an_npu_export(tmp_path):
    (tmp_path / "quant_model_description.json").write_text("{}")
    argv, env = vllm_command(tmp_path, "0.0.0.0", 9000, draft="none")
    assert argv[argv.index("--quantization") + 1] == "ascend" and "--speculative-config" not in argv and env == {}
    with pytest.raises(QuasarError, match="ngram or none"):
        vllm_command(tmp_path, "0.0.0.0", 9000, draft="layerskip")


def test_vllm_refuses_an_int8_head(tiny_int8_head_artifact, tiny_artifact, monkeypatch):
    """vLLM is not known to load a compressed-tensors int8 lm_head: refused in one line, before vLLM is looked for."""
    from click.testing import CliRunner

    from quasar_deploy.cli import main

    with pytest.raises(QuasarError, match="lm_head is int8"):
        vllm_command(tiny_int8_head_artifact.path, "0.0.0.0", 8000)
    assert vllm_command(tiny_artifact.path, "0.0.0.0", 8000)[0][2] == str(tiny_artifact.path)  # the head stays float
    monkeypatch.setenv("PATH", "")
    result = CliRunner().invoke(main, ["serve", str(tiny_int8_head_artifact.path), "--engine", "vllm"])
    assert_one_line_error(result, "lm_head is int8")


def test_missing_vllm_is_one_line(monkeypatch):
    monkeypatch.setenv("PATH", "")
    with pytest.raises(QuasarError, match="vllm is not installed"):
        exec_vllm(["vllm", "serve", "x"], {})


def test_serve_cli_with_vllm_missing_says_so(monkeypatch, tmp_path):
    from click.testing import CliRunner

    from quasar_deploy.cli import main

    monkeypatch.setenv("PATH", "")
    result = CliRunner().invoke(main, ["serve", str(tmp_path), "--engine", "vllm"])
    assert result.exit_code == 1 and result.output.strip().startswith("error: vllm is not installed")


def test_what_was_loaded_before_serving_is_frozen_out_of_the_collector_and_garbage_is_not_kept():
    """``run`` freezes what the process holds (the model, for the server's life) so the cyclic collector's passes skip
    it, after collecting the garbage there is: a cycle made before is gone, not frozen with the rest."""
    import gc
    import weakref

    from quasar_deploy.serve.server import freeze_loaded_objects

    class Node:
        pass

    cycle = Node()
    cycle.self = cycle
    dropped = weakref.ref(cycle)
    del cycle
    try:
        freeze_loaded_objects()
        assert dropped() is None and gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
