"""Tensor names grouped by decoder layer, so exporters write (and report progress) one layer at a time."""

from __future__ import annotations

from collections.abc import Iterable

from ..decoder_spec import DecoderSpec


def by_layer(names: Iterable[str], spec: DecoderSpec) -> list[tuple[str, list[str]]]:
    """``[(label, names)]``: what precedes the layers (embeddings), each layer in order, then the rest (final norm, lm_head)."""
    names = sorted(names)
    prefixes = [f"{spec.layer_prefix(i)}." for i in range(spec.num_layers)]
    layers = [(f"layer {i}", [n for n in names if n.startswith(prefix)]) for i, prefix in enumerate(prefixes)]
    in_layers = {n for _, group in layers for n in group}
    rest = [n for n in names if n not in in_layers]
    head = [n for n in rest if "embed" in n]
    tail = [n for n in rest if "embed" not in n]
    return [("embeddings", head), *layers, ("head", tail)]
