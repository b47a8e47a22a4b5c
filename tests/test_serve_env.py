"""Every `serve` option comes from QUASAR_<NAME> too (what containers configure), checked option by option, generically:
an option added later is covered without touching this test."""

from __future__ import annotations

import click
import pytest

from quasar_deploy.cli.serve import serve

OPTIONS = [p for p in serve.params if isinstance(p, click.Option)]


def env_name(option: click.Option) -> str:
    return "QUASAR_" + max(option.opts, key=len).lstrip("-").upper().replace("-", "_")


def value_for(option: click.Option, tmp_path) -> str:
    """A valid value for the option, other than its default, as the environment would spell it."""
    kind = option.type
    if option.is_flag:
        return "0" if option.default else "1"
    if isinstance(kind, click.Choice):
        return next(c for c in reversed(kind.choices) if c != option.default)
    if isinstance(kind, click.Path) and not kind.file_okay:
        return str(tmp_path)
    if isinstance(kind, click.Path):
        file = tmp_path / f"{option.name}.txt"
        file.write_text("{{ messages }}")
        return str(file)
    if isinstance(kind, (click.IntRange, click.FloatRange)) or kind in (click.INT, click.FLOAT):
        low = getattr(kind, "min", None) or 0
        return str(int(low) + 3)
    return f"from-env-{option.name}"


def test_every_option_has_its_variable():
    assert OPTIONS and all(option.envvar == env_name(option) for option in OPTIONS)
    assert len({option.envvar for option in OPTIONS}) == len(OPTIONS)


@pytest.mark.parametrize("option", OPTIONS, ids=lambda o: o.name)
def test_each_option_reads_its_variable(option, monkeypatch, tmp_path):
    raw = value_for(option, tmp_path)
    monkeypatch.setenv(env_name(option), raw)
    context = serve.make_context("serve", ["model-dir"])
    want = option.type_cast_value(context, option.type.split_envvar_value(raw) if option.multiple else raw)
    assert context.params[option.name] == want and want != option.default


def test_the_command_line_wins_and_unset_means_default(monkeypatch):
    monkeypatch.setenv("QUASAR_PORT", "9001")
    assert serve.make_context("serve", ["m", "--port", "9002"]).params["port"] == 9002
    assert serve.make_context("serve", ["m"]).params["port"] == 9001
    monkeypatch.delenv("QUASAR_PORT")
    assert serve.make_context("serve", ["m"]).params["port"] == 8000


def test_a_bad_value_in_the_environment_is_a_usage_error(monkeypatch):
    monkeypatch.setenv("QUASAR_NUM_DRAFT", "lots")
    with pytest.raises(click.BadParameter, match="QUASAR_NUM_DRAFT|lots"):
        serve.make_context("serve", ["m"])
