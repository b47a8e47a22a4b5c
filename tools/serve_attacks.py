"""The attacks of issue 44 against `quasar-deploy serve`, measured as they were reported (docs/security.md).

Each attack starts a server (127.0.0.1 only) on a copy of a model directory (default: the shipped demo model) carrying
the attack's ``chat_template.jinja``, times a plain completion alone (median of 5), then again while the attack goes
on, and reads the memory of the server's process and its children before, at the peak and after:

    python tools/serve_attacks.py loop huge give-up body drain
    python tools/serve_attacks.py loop huge give-up body drain --code OLD  # OLD: a checkout of the commit before

- ``loop``: three chats at once against a template that loops;
- ``huge``: three chats at once against ``{{ 'ab ' * 5000000 }}{{ messages[0].content }}``;
- ``give-up``: eight completions of 1900 tokens whose clients time out after 1 s, then plain completions for 5 s;
- ``body``: four requests whose clients go while sending their bodies; the /metrics statuses, tracebacks logged;
- ``drain``: a stream of 1900 tokens, then SIGTERM with ``--drain-timeout 2``: the time to exit, the stream's end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from quasar_deploy.memory import tree_resident_mib

LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}"
HUGE = "{{ 'ab ' * 5000000 }}{{ messages[0].content }}"
PLAIN_TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}"
PLAIN = {"model": "m", "prompt": "def add(a, b):\n", "temperature": 0, "max_tokens": 32}
LONG = {"model": "m", "prompt": "def f(x):\n", "temperature": 0, "max_tokens": 1900, "draft": "none"}  # greedy: no early stop
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


class Server:
    """``quasar-deploy serve`` on a copy of ``model`` with ``template`` as its chat template."""

    def __init__(self, model: Path, template: str, port: int, code: Path | None, *flags: str):
        self.directory = Path(tempfile.mkdtemp(prefix="serve-attacks-"))
        copy = self.directory / "m"
        shutil.copytree(model, copy)
        (copy / "chat_template.jinja").write_text(template)
        self.log = self.directory / "server.log"
        command = ["quasar-deploy", "serve", str(copy), "--port", str(port), "--model-name", "m", *flags]
        env = {**os.environ, "PYTHONPATH": str(code)} if code else None  # another checkout's quasar_deploy serves
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=self.log.open("w"), env=env)
        self.base, self.port = f"http://127.0.0.1:{port}", port
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and self.process.poll() is None:
            try:
                if httpx.get(f"{self.base}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.1)
        raise SystemExit(f"the server did not start: {self.log.read_text()[-2000:]}")

    def plain(self) -> float:
        began = time.monotonic()
        response = httpx.post(f"{self.base}/v1/completions", json=PLAIN, timeout=300)
        assert response.status_code == 200, response.text
        return time.monotonic() - began

    def alone(self) -> float:
        self.plain()
        return statistics.median(self.plain() for _ in range(5))

    def memory(self) -> float:
        return tree_resident_mib(self.process.pid)

    def statuses(self) -> list[str]:
        text = httpx.get(f"{self.base}/metrics", timeout=10).text
        return [line for line in text.splitlines() if line.startswith('quasar_requests_total{endpoint="/v1/')]

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()
        shutil.rmtree(self.directory)


def under(server: Server, attack: Callable[[], object], after_s: float = 0.0) -> str:
    """Plain completions while ``attack`` runs (or, with ``after_s``, for that long once it has ended: the clients of
    ``give-up`` are served until they go), against their time alone; the memory."""
    alone = server.alone()
    time.sleep(1)
    before, peak, during = server.memory(), 0.0, []
    with ThreadPoolExecutor(1) as pool:
        attacking = pool.submit(attack)
        time.sleep(0.3)
        while not after_s and not attacking.done():
            during.append(server.plain())
            peak = max(peak, server.memory())
        outcome = attacking.result()
    ended = time.monotonic()
    while time.monotonic() - ended < after_s:
        during.append(server.plain())
        peak = max(peak, server.memory())
    time.sleep(2)
    after = server.memory()
    return (
        f"plain completion alone {alone:.3f} s; during {len(during)}: median {statistics.median(during):.3f} s, max {max(during):.3f} s "
        f"({max(during) / alone:.1f}x); memory {before:.0f} -> peak {peak:.0f} -> {after:.0f} MiB ({(after / before - 1) * 100:+.1f}%); "
        f"attack: {outcome}"
    )


def chats(server: Server) -> list[tuple[int, float, str]]:
    def chat(_: int) -> tuple[int, float, str]:
        began = time.monotonic()
        response = httpx.post(f"{server.base}/v1/chat/completions", json=CHAT, timeout=300)
        return response.status_code, round(time.monotonic() - began, 2), response.json().get("error", {}).get("message", "")

    with ThreadPoolExecutor(3) as pool:
        return list(pool.map(chat, range(3)))


def give_up(server: Server) -> list[str]:
    def one(_: int) -> None:
        try:
            httpx.post(f"{server.base}/v1/completions", json=LONG, timeout=1)
        except httpx.TimeoutException:
            pass

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(one, range(8)))
    return server.statuses()


def cut_bodies(server: Server) -> list[str]:
    for _ in range(4):
        with socket.create_connection(("127.0.0.1", server.port)) as connection:
            connection.sendall(b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{"model": ')
            time.sleep(0.2)
    time.sleep(1)
    return [*server.statuses(), f"tracebacks logged: {server.log.read_text().count('Traceback')}"]


def drain(model: Path, port: int, code: Path | None, timeout: float) -> str:
    server = Server(model, PLAIN_TEMPLATE, port, code, "--drain-timeout", str(timeout))
    lines: list[str] = []

    def stream() -> None:
        try:
            with httpx.stream("POST", f"{server.base}/v1/completions", json={**LONG, "stream": True}, timeout=120) as response:
                lines.extend(line for line in response.iter_lines() if line)
        except httpx.TransportError as exc:
            lines.append(f"(cut: {exc})")

    client = threading.Thread(target=stream)
    client.start()
    time.sleep(1)
    began = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    code = server.process.wait(120)
    elapsed = time.monotonic() - began
    client.join(30)
    shutil.rmtree(server.directory)
    ending = [line[:100] for line in lines[-2:]]
    return f"--drain-timeout {timeout:g}: exit code {code} after {elapsed:.2f} s; the stream's last lines: {ending}"


def main() -> None:
    from quasar_deploy.demo import demo_model_path

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("attacks", nargs="+", choices=["loop", "huge", "give-up", "body", "drain"])
    parser.add_argument("--model", type=Path, default=demo_model_path(), help="a model directory (default: the demo model)")
    parser.add_argument("--port", type=int, default=8471)
    parser.add_argument("--code", type=Path, help="the directory holding the quasar_deploy that serves (a checkout of another commit)")
    args = parser.parse_args()
    for attack in args.attacks:
        if attack == "drain":
            print(attack, drain(args.model, args.port, args.code, 2.0), flush=True)
            continue
        template = {"loop": LOOP, "huge": HUGE}.get(attack, PLAIN_TEMPLATE)
        server = Server(args.model, template, args.port, args.code)
        try:
            if attack in ("loop", "huge"):
                print(attack, under(server, lambda s=server: chats(s)), flush=True)
            elif attack == "give-up":
                print(attack, under(server, lambda s=server: give_up(s), after_s=5), flush=True)
            else:
                print(attack, under(server, lambda s=server: cut_bodies(s)), flush=True)
        finally:
            server.stop()


if __name__ == "__main__":
    main()
