"""The drafters users can pick, by name: one table that the engine, the CLI and the benchmark all read.

Factories are ``"module:callable"``, imported on first use, so reading the table loads no torch."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import QuasarError
from ..lazy import resolve

if TYPE_CHECKING:
    from .drafters import Drafter, DrafterContext


@dataclass(frozen=True)
class DrafterEntry:
    """``factory(context, options)`` builds a drafter for one generation; ``num_draft``: its k when a generation names none."""

    factory: str
    options: tuple[str, ...]
    help: str
    num_draft: int = 5  # the Quasar paper's k


DRAFTERS: dict[str, DrafterEntry] = {
    "none": DrafterEntry("quasar_deploy.speculative.drafters:no_drafter", (), "plain autoregressive decoding on the verifier"),
    "ngram": DrafterEntry(
        "quasar_deploy.speculative.ngram:ngram_drafter", ("ngram_min", "ngram_max"), "prompt lookup: continue a repeated n-gram"
    ),
    "suffix": DrafterEntry(
        "quasar_deploy.speculative.suffix:suffix_drafter",
        ("suffix_min_prob",),
        "suffix tree: the most frequent continuation of the longest matching context, variable length",
        num_draft=16,  # its drafts stop where the counts say, so the cap is the tree's depth (as vLLM's)
    ),
    "layerskip": DrafterEntry(
        "quasar_deploy.speculative.layerskip:layerskip_drafter",
        ("skip_layers", "skip_fraction"),
        "the verifier itself with some layers skipped",
    ),
    "model": DrafterEntry("quasar_deploy.speculative.draft_model:model_drafter", ("draft_model",), "a small draft model, same tokenizer"),
}


def drafter_entry(name: str) -> DrafterEntry:
    if name not in DRAFTERS:
        raise QuasarError(f"unknown drafter {name!r}; choose from {', '.join(DRAFTERS)}")
    return DRAFTERS[name]


def default_num_draft(name: str) -> int:
    """The k that ``name`` drafts up to where a generation, a server or a benchmark sets none."""
    return drafter_entry(name).num_draft


def check_drafter_options(name: str, given: Iterable[str]) -> None:
    """Refuse any option in ``given`` (those set to other than their defaults) that another drafter owns and ``name`` does not read."""
    reads = drafter_entry(name).options
    for option in given:
        if option in reads:
            continue
        if (owner := next((n for n, e in DRAFTERS.items() if option in e.options), None)) is not None:
            raise QuasarError(f"{option} applies to draft={owner!r}, not draft={name!r}")


def create_drafter(name: str, context: DrafterContext, options: Mapping[str, Any]) -> Drafter:
    """A fresh drafter ``name``, given the whole ``options`` mapping (its factory sees only the options it reads)."""
    entry = drafter_entry(name)
    return resolve(entry.factory)(context, {option: options[option] for option in entry.options})
