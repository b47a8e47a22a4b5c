"""The end-to-end benchmark's mode names, read off the drafter table so that ``--modes`` help lists them without torch.

A mode is ``<drafter>-<precision>`` on the cpu backend ("ar": no drafter), with ``-adaptive`` (k follows acceptance) or
``-ort`` (exported ONNX graphs), exact mode, a comparison (transformers, a pruned verifier) or another engine (``anchors``)."""

from __future__ import annotations

from ..speculative.registry import DRAFTERS, default_num_draft
from .anchors import ANCHOR_MODES

PRECISIONS = ("float", "w8a8")
_DRAFTERS = tuple(name for name in DRAFTERS if name != "model")  # a draft model is a second checkpoint, not taken here
_AR = "ar"

ORT_MODES = ("ar-float-ort", "ngram-float-ort", "ngram-w8a8-ort", "exact-ngram-ort", "exact-ngram-ort-draft")
# exact mode's float verifier and W8A8 drafter: both on cpu, both on ONNX Runtime, or cpu's float with ORT's W8A8 (auto's on a bf16 CPU)
EXACT_MODES = {"exact-ngram": "cpu", "exact-ngram-ort": "ort", "exact-ngram-ort-draft": "ort-draft"}
# the model-free drafters with k per sequence (``speculative.draft_length``), on the W8A8 verifier Quasar deploys
ADAPTIVE_MODES = ("ngram-w8a8-adaptive", "suffix-w8a8-adaptive")
MODES = (
    *(f"{_AR if drafter == 'none' else drafter}-{precision}" for drafter in _DRAFTERS for precision in PRECISIONS),
    *ADAPTIVE_MODES,
    "hf-prompt-lookup",
    "pruned-verify",
    "exact-ngram",
    *ORT_MODES,
)
ALL_MODES = (*MODES, *ANCHOR_MODES)
LOSSLESS_PAIRS = (
    ("ngram-float", "ar-float"),
    ("layerskip-float", "ar-float"),
    ("ngram-w8a8", "ar-w8a8"),
    ("suffix-float", "ar-float"),
    ("suffix-w8a8", "ar-w8a8"),
    ("ngram-w8a8-adaptive", "ar-w8a8"),
    ("suffix-w8a8-adaptive", "ar-w8a8"),
    ("layerskip-w8a8", "ar-w8a8"),
    ("ngram-float-ort", "ar-float-ort"),
    ("exact-ngram", "ar-float"),  # exact mode's output is the float model's own
    ("exact-ngram", "ngram-float"),  # the same, where a run times float n-gram verification only
    ("exact-ngram-ort", "ar-float-ort"),
    ("exact-ngram-ort-draft", "ar-float"),
)


def drafter_and_precision(mode: str) -> tuple[str, str]:
    """``"ar-w8a8"`` -> ``("none", "w8a8")``, ``"ngram-float-ort"`` -> ``("ngram", "float")``: what the engine is asked for."""
    kind, precision = mode.split("-")[:2]
    return "none" if kind == _AR else kind, precision


def ort_precisions(mode: str) -> tuple[str, ...]:
    """The ONNX engines (by precision) an ``-ort`` mode runs on: exact mode both, or only the W8A8 one that drafts."""
    if mode in EXACT_MODES:
        return ("w8a8",) if EXACT_MODES[mode] == "ort-draft" else PRECISIONS
    return (drafter_and_precision(mode)[1],)


def k_text(num_draft: int | None, drafter: str | None = None) -> str:
    """A report's words for the draft length asked (None: each drafter's own, ``drafter``'s where the report is of one)."""
    if num_draft is not None:
        return f"k={num_draft}"
    if drafter is not None:
        return f"k={default_num_draft(drafter)}"
    own = ", ".join(f"{name} {entry.num_draft}" for name, entry in DRAFTERS.items() if name in ("ngram", "suffix"))
    return f"k: each drafter's own ({own})"
