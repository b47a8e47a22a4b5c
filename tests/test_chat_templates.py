"""Chat templates render in a process of their own, bounded in time, in the size of what they make and in memory: a
template past a bound is refused in one line, and what it took is given back (issue 44).

Before, a template rendered in the caller's process under a time limit only: ``{{ 'ab ' * 5000000 }}`` rendered in
milliseconds and its 15 MB were tokenized for 22 s into 3.2 GB that the process kept, and in the server a looping
template held the scheduler's thread (tests/test_serve_attacks.py has the server's side).
"""

from __future__ import annotations

import asyncio
import gc
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from quasar_deploy.artifact import open_model_files
from quasar_deploy.chat.renderer import ChatRenderer, RendererError
from quasar_deploy.errors import QuasarError
from quasar_deploy.memory import tree_resident_mib
from quasar_deploy.tokenizer import load_tokenizer

from .helpers import copy_dir
from .serving import CHAT_TEMPLATE

SECONDS = 1.0
MAX_CHARS = 8192
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def f(x):\n    return"}]
LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}"
# each makes the renderer refuse: (template, a pattern of its one-line error)
RUNAWAY = {
    "nested loops": (LOOP, f"did not finish rendering within {SECONDS:g} s"),
    "loops over the messages": (
        "{% for m in messages %}{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}{% endfor %}",
        "did not finish rendering within",
    ),
    "a counter in a namespace": (
        "{% set ns = namespace(n=0) %}{% for i in range(100000) %}{% for j in range(100000) %}{% set ns.n = ns.n + 1 %}"
        "{% endfor %}{% endfor %}",
        "did not finish rendering within",
    ),
    # 1.5 MB: far over the size bound, and built well within the time bound on a loaded machine (15 MB took over 1 s)
    "a string multiplied": ("{{ 'ab ' * 500000 }}{{ messages[0].content }}", "a prompt of 1,500,009 characters, over the limit of 8,192"),
    "a message multiplied": ("{{ messages[1].content * 1000000 }}", "over the limit of 8,192"),
    "a padded string": ("{{ 'a'.ljust(10**9) }}", "needed more than 512 MiB to render"),
    "a string doubled": (
        "{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
        "512 MiB|did not finish rendering within",  # the bound it meets first depends on the machine's load
    ),
    "joins": ("{% for i in range(100) %}{{ range(100000)|join(' ') }}{% endfor %}", "rendering within|over the limit|512 MiB"),
}


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen3):
    tokenizer = load_tokenizer(open_model_files(tiny_qwen3))
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def renderer(tokenizer):
    renderer = ChatRenderer(tokenizer, MAX_CHARS, seconds=SECONDS)
    renderer.start()
    yield renderer
    renderer.close()


def in_process(tokenizer, messages) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))


@pytest.mark.parametrize(
    "template",
    [
        CHAT_TEMPLATE,
        "{{ bos_token }}{% for m in messages %}[{{ m.role | upper }}] {{ m.content }}{{ eos_token }}{% endfor %}"
        "{% if add_generation_prompt %}[ASSISTANT]{% endif %}",
        "{{ messages | tojson }}{{ messages | length }}",
        "{% for m in messages %}{% if loop.first %}¶ {% endif %}{{ m.content }} é 漢 🙂\n{% endfor %}",
    ],
)
def test_a_chat_renders_as_the_tokenizer_renders_it_in_process(renderer, tokenizer, template, monkeypatch):
    monkeypatch.setattr(tokenizer, "chat_template", template)
    assert renderer.render(MESSAGES) == in_process(tokenizer, MESSAGES)


@pytest.mark.parametrize("name", RUNAWAY)
def test_a_runaway_template_is_refused_in_one_line_within_its_bound(renderer, tokenizer, name, monkeypatch):
    template, message = RUNAWAY[name]
    monkeypatch.setattr(tokenizer, "chat_template", template)
    before, began = tree_resident_mib(), time.monotonic()
    with pytest.raises(QuasarError, match="^[^\n]*$") as refused:
        renderer.render(MESSAGES)
    assert re.search(message, str(refused.value)) and not isinstance(refused.value, RendererError), refused.value
    assert time.monotonic() - began < SECONDS + 3
    deadline = time.monotonic() + 5  # the render's child is reaped at once; its pages may take the kernel a moment
    while tree_resident_mib() > before + 20 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert tree_resident_mib() < before + 20  # MiB: this process and the renderer's kept nothing of it


@pytest.mark.parametrize(
    "template, message",
    [
        ("{{ raise_exception('system messages are not supported\\nby this template') }}", "system messages are not supported"),
        ("{% for m in messages %}", "rejected the messages: Unexpected end of template"),
        ("{{ messages[7].content }}", "rejected the messages"),
        ("{{ 1 / 0 }}", "division by zero"),
        ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "recursion"),
        ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "rejected the messages"),  # the sandbox's refusal
    ],
)
def test_a_template_that_refuses_its_messages_says_why_in_one_line(renderer, tokenizer, template, message, monkeypatch):
    monkeypatch.setattr(tokenizer, "chat_template", template)
    with pytest.raises(QuasarError, match="^[^\n]*$") as refused:
        renderer.render(MESSAGES)
    assert message in str(refused.value), refused.value


def test_a_runaway_render_holds_up_no_other(renderer, tokenizer, monkeypatch):
    """Renders run side by side: a chat rendered while a looping one runs is answered in its usual time."""
    monkeypatch.setattr(tokenizer, "chat_template", LOOP)
    refusals: list[str] = []

    def loop() -> None:
        try:
            renderer.render(MESSAGES)
        except QuasarError as exc:
            refusals.append(str(exc))

    looping = threading.Thread(target=loop)
    looping.start()
    time.sleep(0.2)
    monkeypatch.setattr(tokenizer, "chat_template", CHAT_TEMPLATE)
    began = time.monotonic()
    assert renderer.render(MESSAGES) == in_process(tokenizer, MESSAGES)
    assert time.monotonic() - began < SECONDS / 2 and looping.is_alive()
    looping.join()
    assert refusals and "did not finish rendering" in refusals[0]


def render_children() -> list[int]:
    """The processes the renderer's process has forked for renders now."""
    workers = [p for p in Path("/proc").iterdir() if p.name.isdigit() and b"quasar_deploy.chat.worker" in read(p / "cmdline")]
    mine = [int(p.name) for p in workers if parent(p) == os.getpid()]
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit() and parent(p) in mine]


def read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""


def parent(process: Path) -> int:
    stat = read(process / "stat").decode()
    return int(stat[stat.rindex(")") + 2 :].split()[1]) if stat else -1


def test_a_render_nobody_waits_for_is_killed(tiny_qwen3, tokenizer, monkeypatch):
    """The server cancels the render of a client gone: its child is killed at once, not at the time bound."""
    monkeypatch.setattr(tokenizer, "chat_template", LOOP)
    renderer = ChatRenderer(tokenizer, MAX_CHARS, seconds=60)

    async def abandon() -> None:
        render = asyncio.ensure_future(renderer.render_async(MESSAGES))
        deadline = time.monotonic() + 30
        while not render_children() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert render_children() and renderer.busy == 1
        render.cancel()
        with pytest.raises(asyncio.CancelledError):
            await render

    try:
        asyncio.run(abandon())
        deadline = time.monotonic() + 2
        while render_children() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not render_children() and renderer.busy == 0
    finally:
        renderer.close()


def test_the_renderer_starts_again_after_its_process_dies(renderer, tokenizer):
    renderer.render(MESSAGES)
    process = renderer._process.process
    process.kill()
    process.wait()
    deadline = time.monotonic() + 5
    while not renderer._process.stopped and time.monotonic() < deadline:
        time.sleep(0.02)
    assert renderer.render(MESSAGES) == in_process(tokenizer, MESSAGES) and renderer._process.process is not process


def test_the_renderers_process_ends_with_the_renderer(tokenizer):
    renderer = ChatRenderer(tokenizer, MAX_CHARS)
    renderer.render(MESSAGES)
    process = renderer._process.process
    del renderer
    gc.collect()
    assert process.wait(10) is not None


# the CLI in a process of its own, which reports its peak resident memory as it exits (VmHWM: ru_maxrss would carry the
# parent's peak over the exec)
CLI = (
    "import atexit, sys\n"
    "peak = lambda: next(int(l.split()[1]) // 1024 for l in open('/proc/self/status') if l.startswith('VmHWM'))\n"
    "atexit.register(lambda: print(f'peak {peak()} MiB', file=sys.stderr))\n"
    "from quasar_deploy.cli import main\n"
    "main()\n"
)


@pytest.mark.parametrize("name", ["a string multiplied", "a padded string", "a string doubled"])
def test_generate_chat_refuses_a_runaway_template_in_one_line(tiny_qwen3, tmp_path, name):
    """The model directory's own ``chat_template.jinja``, as an artifact from elsewhere would carry it: one line, exit 1,
    and the command's memory stays that of the model (it took 3.2 GB and 26 s before)."""
    model = copy_dir(tiny_qwen3, tmp_path)
    (model / "chat_template.jinja").write_text(RUNAWAY[name][0])
    command = [sys.executable, "-c", CLI, "generate", str(model), "--prompt", "def f(x):", "--chat", "--backend", "cpu"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    *output, peak = done.stderr.strip().splitlines()
    assert done.returncode == 1 and output == [output[0]] and output[0].startswith("error: "), done.stderr
    assert re.search(RUNAWAY[name][1], output[0]), done.stderr
    assert int(peak.split()[1]) < 1024, peak
