"""The chat-template renderer's process: ``python -m quasar_deploy.chat.worker``, started by ``renderer.ChatRenderer``.

A template is the model author's program: each render runs in a forked child, bounded in memory and time, at a lower
priority, ``processes`` at once. The process stays single-threaded, as one that forks must."""

from __future__ import annotations

import ctypes
import json
import math
import os
import pickle
import resource
import selectors
import signal
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, NoReturn

from ..files import first_line
from .frames import SETUP, FrameReader, frame, reply_limit, write_all

RENDER_NICE = 10  # added to the server's niceness: a spinning render yields the CPU to the scheduler
READ_SIZE = 1 << 16
SETUP_LIMIT = 1 << 31  # the first frame carries the tokenizer
EXIT_POLL_S = 0.005  # a child that has closed its output is exiting: look for its exit this often
MESSAGE_CHARS = 500  # of an error's line: an exception's message can hold the template's whole output
PR_SET_PDEATHSIG = 1  # Linux prctl: a signal the child gets when its parent exits


@dataclass(eq=False)
class Child:
    """A render in progress: its request's tag, the forked process, the read end of its output, when it is killed."""

    tag: int
    pid: int
    fd: int | None
    deadline: float
    output: bytearray = field(default_factory=bytearray)


def main() -> None:
    """Read the setup (the tokenizer and the bounds), say ready, then serve renders until the server closes the pipe."""
    out = os.dup(1)
    os.dup2(2, 1)  # whatever a library prints goes to stderr, never into the frames
    os.nice(RENDER_NICE)
    reader = FrameReader(SETUP_LIMIT)
    frames: list[tuple[int, bytes]] = []
    while not frames:
        if not (data := os.read(0, READ_SIZE)):
            return
        frames = reader.feed(data)
    try:
        setup = pickle.loads(frames[0][1])  # from the server that started this process: trusted
    except Exception as exc:  # a tokenizer class this process cannot import
        write_all(out, frame(SETUP, json.dumps({"error": f"cannot load the tokenizer: {first_line(exc)}"}).encode()))
        return
    write_all(out, frame(SETUP, b'{"ready": true}'))
    reader.limit = 1 << 30  # requests: the messages of one chat, which the server has already bounded
    Renders(setup.pop("tokenizer"), setup, out).serve(reader, frames[1:])


class Renders:
    """The renders waiting and running, driven by one loop over the server's pipe and the children's outputs."""

    def __init__(self, tokenizer: Any, bounds: dict[str, Any], out: int):
        self.tokenizer, self.bounds, self.out = tokenizer, bounds, out
        self.max_reply = reply_limit(bounds["max_chars"])
        self.waiting: deque[tuple[int, dict]] = deque()
        self.running: dict[int, Child] = {}
        self.selector = selectors.DefaultSelector()
        self.selector.register(0, selectors.EVENT_READ)

    def serve(self, reader: FrameReader, frames: list[tuple[int, bytes]]) -> None:
        self._requests(frames)
        while True:
            self._start_waiting()
            for key, _ in self.selector.select(self._timeout()):
                if key.data is not None:
                    self._read(key.data)
                    continue
                if not (data := os.read(0, READ_SIZE)):  # the server has gone, and its renders with it
                    for child in list(self.running.values()):
                        self._kill(child)
                    return
                self._requests(reader.feed(data))
            self._settle()

    def _timeout(self) -> float | None:
        if not self.running:
            return None
        if any(child.fd is None for child in self.running.values()):
            return EXIT_POLL_S
        return max(0.0, min(child.deadline for child in self.running.values()) - time.monotonic())

    def _requests(self, frames: list[tuple[int, bytes]]) -> None:
        for tag, payload in frames:
            request = json.loads(payload)
            if not request.get("cancel"):
                self.waiting.append((tag, request))
                continue
            self.waiting = deque(item for item in self.waiting if item[0] != tag)
            if tag in self.running:
                self._kill(self.running[tag])  # nobody waits for its answer

    def _start_waiting(self) -> None:
        while self.waiting and len(self.running) < self.bounds["processes"]:
            tag, request = self.waiting.popleft()
            read_end, write_end = os.pipe()
            if (pid := os.fork()) == 0:
                render_in_child(write_end, self.tokenizer, self.bounds, request)
            os.close(write_end)
            self.running[tag] = child = Child(tag, pid, read_end, time.monotonic() + self.bounds["seconds"])
            self.selector.register(read_end, selectors.EVENT_READ, child)

    def _read(self, child: Child) -> None:
        if not (data := os.read(child.fd, READ_SIZE)):  # its output is complete: it is exiting
            self._close(child)
        elif len(child.output) + len(data) > self.max_reply:
            self._kill(child)
            self._reply(child.tag, f"the chat template's render wrote more than {self.max_reply:,} bytes")
        else:
            child.output += data

    def _settle(self) -> None:
        """Answer the renders that ended, and end those past their time."""
        for child in list(self.running.values()):
            pid, status = os.waitpid(child.pid, os.WNOHANG) if child.fd is None else (0, 0)
            if pid == 0:
                if time.monotonic() >= child.deadline:
                    self._kill(child)
                    seconds = self.bounds["seconds"]
                    self._reply(child.tag, f"the chat template did not finish rendering within {seconds:g} s (an unbounded loop?)")
                continue
            del self.running[child.tag]
            code = os.waitstatus_to_exitcode(status)
            if code == 0 and child.output:
                write_all(self.out, frame(child.tag, bytes(child.output)))  # the server checks what it holds
            else:
                how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with {code}"
                mib = self.bounds["memory_bytes"] >> 20
                self._reply(child.tag, f"rendering the chat template failed: its process {how} (a render may use {mib} MiB)")

    def _reply(self, tag: int, error: str) -> None:
        write_all(self.out, frame(tag, json.dumps({"error": error}).encode()))

    def _close(self, child: Child) -> None:
        if child.fd is not None:
            self.selector.unregister(child.fd)
            os.close(child.fd)
            child.fd = None

    def _kill(self, child: Child) -> None:
        os.kill(child.pid, signal.SIGKILL)
        os.waitpid(child.pid, 0)
        self._close(child)
        del self.running[child.tag]


def render_in_child(fd: int, tokenizer: Any, bounds: dict[str, Any], request: dict) -> NoReturn:
    """In the forked child: confine it, render, write the reply to ``fd`` and exit, whatever happens."""
    status = 1
    try:
        confine(fd, bounds)
        try:
            reply = render(tokenizer, bounds["max_chars"], request)
        except MemoryError:
            reply = {"error": f"the chat template needed more than {bounds['memory_bytes'] >> 20} MiB to render"}
        write_all(fd, json.dumps(reply).encode())
        status = 0
    finally:
        os._exit(status)


def confine(fd: int, bounds: dict[str, Any]) -> None:
    """Only ``fd`` open (stdio to /dev/null), the memory and CPU limits set, and killed if the renderer's process dies."""
    os.closerange(3, fd)
    os.closerange(fd + 1, os.sysconf("SC_OPEN_MAX"))
    devnull = os.open(os.devnull, os.O_RDWR)
    for std in (0, 1, 2):
        os.dup2(devnull, std)
    os.close(devnull)
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        size = int(open("/proc/self/statm").read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        limit = size + bounds["memory_bytes"]
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    cpu = math.ceil(bounds["seconds"]) + 1  # a backstop: the renderer's process kills it at its deadline
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))


def render(tokenizer: Any, max_chars: int, request: dict) -> dict[str, Any]:
    """The ids of the chat's prompt, or the one-line reason there are none."""
    tokenizer.chat_template = request["template"]
    try:
        text = tokenizer.apply_chat_template(request["messages"], tokenize=False, add_generation_prompt=True)
    except MemoryError:
        raise
    except Exception as exc:  # jinja2's errors, raise_exception() in a template: the messages do not fit the template
        return {"error": f"the chat template rejected the messages: {first_line(exc)[:MESSAGE_CHARS]}"}
    if len(text) > max_chars:
        return {"error": f"the chat template made a prompt of {len(text):,} characters, over the limit of {max_chars:,} for this model"}
    return {"ids": list(tokenizer.encode(text, add_special_tokens=False))}


if __name__ == "__main__":
    main()
