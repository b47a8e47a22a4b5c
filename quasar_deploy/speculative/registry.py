"""The drafters users can pick, by name: one table that the engine, the CLI and the benchmark all read.

Each entry names its factory as ``"module:callable"``, imported on first use, so reading the
table (for ``--help`` choices, say) loads no torch. ``options`` are the generation options the
drafter reads; giving one that the chosen drafter does not read is an error.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DrafterEntry:
    factory: str
    options: tuple[str, ...]
    help: str


DRAFTERS: dict[str, DrafterEntry] = {
    "none": DrafterEntry("quasar_deploy.speculative.drafters:NoDrafter", (), "plain autoregressive decoding on the verifier"),
    "ngram": DrafterEntry(
        "quasar_deploy.speculative.ngram:NgramDrafter", ("ngram_min", "ngram_max"), "prompt lookup: continue a repeated n-gram"
    ),
    "layerskip": DrafterEntry(
        "quasar_deploy.speculative.layerskip:LayerSkipDrafter",
        ("skip_layers", "skip_fraction"),
        "the verifier itself with some layers skipped",
    ),
    "model": DrafterEntry("quasar_deploy.speculative.draft_model:ModelDrafter", ("draft_model",), "a small draft model, same tokenizer"),
}
