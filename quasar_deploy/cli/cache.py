"""``quasar-deploy cache list|clear|path``: what the cache holds (ONNX exports, demo artifacts), and clearing it."""

from __future__ import annotations

import datetime
import json

import click

from ..cache import cache_dir, clear, entries, parse_age, size_limit


@click.group("cache")
def cache_group() -> None:
    """The cache of derived files: ONNX exports that backend auto runs, the demo's artifacts. Its size is capped by
    $QUASAR_CACHE_MAX (e.g. 50G; default a quarter of its disk), least recently used entries evicted first."""


@cache_group.command("path")
def path_command() -> None:
    """Print the cache directory ($QUASAR_CACHE, else ~/.cache/quasar-deploy)."""
    click.echo(cache_dir())


@cache_group.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
def list_command(as_json) -> None:
    """Every entry, least recently used first: its size, when it was last used, what it was made from (orphaned: gone)."""
    found = entries()
    if as_json:
        click.echo(json.dumps({"path": str(cache_dir()), "limit": size_limit(), "entries": [e.to_dict() for e in found]}, indent=2))
        return
    for entry in found:
        when = datetime.datetime.fromtimestamp(entry.last_used).strftime("%Y-%m-%d %H:%M")
        source = "orphaned: " + ", ".join(entry.sources) + " gone" if entry.orphaned else ", ".join(entry.sources)
        click.echo(f"{entry.bytes / 1e9:8.2f} GB  {when}  {entry.path.name}  {source}".rstrip())
    click.echo(f"{sum(e.bytes for e in found) / 1e9:.2f} GB in {len(found)} entries at {cache_dir()} (limit {size_limit() / 1e9:.1f} GB)")


@cache_group.command("clear")
@click.option("--older-than", metavar="AGE", help="Only entries last used more than AGE ago: 30d, 12h, 90m, 45s.")
def clear_command(older_than) -> None:
    """Remove every entry (or the old ones); whatever is needed again is derived again on its next use."""
    gone = clear(parse_age(older_than) if older_than else None)
    click.echo(f"removed {len(gone)} entries, {sum(e.bytes for e in gone) / 1e9:.2f} GB")
