"""``calibrate``: float checkpoint in, canonical W8A8 artifact out."""

from __future__ import annotations

import datetime
import fnmatch
from collections.abc import Sequence
from pathlib import Path

import torch
from tqdm import tqdm

from .._version import __version__
from ..artifact import ModelFiles, open_model, write_artifact
from ..errors import QuasarError
from ..scheme import QMAX, W8A8Scheme, quantize_weight
from ..tokenizer import load_tokenizer
from . import data, smoothing, stats


def _parse_alpha(alpha: str | float) -> str | float:
    if alpha in ("auto", "off"):
        return alpha
    try:
        value = float(alpha)
    except (TypeError, ValueError):
        raise QuasarError(f"--alpha must be 'auto', 'off' or a number in [0, 1], not {alpha!r}") from None
    if not 0.0 <= value <= 1.0:
        raise QuasarError(f"--alpha must be in [0, 1], not {value}")
    return value


def _keep_float_matches(names: list[str], patterns: Sequence[str]) -> dict[str, str]:
    """Layer name -> the pattern that keeps it in float; a pattern matching nothing is an error."""
    kept: dict[str, str] = {}
    for pattern in patterns:
        hits = [n for n in names if fnmatch.fnmatchcase(n, pattern) or fnmatch.fnmatchcase(n, "*." + pattern)]
        if not hits:
            raise QuasarError(f"--keep-float {pattern!r} matches no linear layer (names look like {names[0]})")
        for name in hits:
            kept.setdefault(name, pattern)
    return kept


def calibrate(
    model_dir: str | Path,
    output: str | Path,
    calib_data: str | Path | None = None,
    num_samples: int = 64,
    seq_len: int = 512,
    alpha: str | float = "auto",
    activation: str = "dynamic",
    keep_float: Sequence[str] = (),
    keep_float_above: float | None = None,
    trust_remote_code: bool = False,
    progress: bool = True,
) -> ModelFiles:
    """Calibrate ``model_dir`` (a local HF checkpoint) into a W8A8 artifact at ``output``; returns it opened.

    ``keep_float``: glob patterns of linear layers to leave in float. ``keep_float_above``:
    also keep in float any layer whose relative quantization error stays above this
    after smoothing (recorded per layer in the manifest).
    """
    alpha = _parse_alpha(alpha)
    if activation not in ("dynamic", "static"):
        raise QuasarError(f"--activation must be 'dynamic' or 'static', not {activation!r}")
    scheme = W8A8Scheme(activation=activation)
    output = Path(output)
    if output.exists():
        raise QuasarError(f"{output}: already exists; choose a new --output or remove it first")
    source = open_model(model_dir)
    if source.is_artifact:
        raise QuasarError(f"{source.path}: is already a W8A8 artifact; calibrate the float checkpoint it came from")
    tokenizer = load_tokenizer(source.path, trust_remote_code)
    texts = data.read_texts(calib_data)
    samples = data.token_samples(tokenizer, texts, num_samples, seq_len)
    if not samples:
        raise QuasarError(f"{calib_data or 'built-in calibration set'}: no sample of at least 2 tokens")

    decoder = source.decoder(torch.float32)
    decoder.prepare("torch", "reference")
    linear_names = [name for name, _ in decoder.linears()]
    kept = _keep_float_matches(linear_names, keep_float)
    groups = source.spec.smooth_groups()
    group_stats = stats.collect(decoder, groups, samples, progress=progress)
    modules = dict(decoder.named_modules())

    group_records, layer_records, static_absmax = [], {}, {}
    for group in tqdm(groups, desc="smoothing + alpha search", unit="group", disable=not progress):
        quantized = [n for n in group.linears if n not in kept]
        weights = {n: modules[n].weight.data.float() for n in quantized}
        st = group_stats[group.name]
        if weights:
            result = smoothing.search(st.rows, st.absmax, weights, alpha, scheme.activation == "static", group.source is not None)
        else:
            result = smoothing.SearchResult(None, None, 0.0, 0.0, {})
        if result.scales is not None:
            smoothing.fold(modules[group.source], [modules[n] for n in group.linears], result.scales)
        input_absmax = st.absmax if result.scales is None else st.absmax / result.scales
        for name in group.linears:
            error = result.layer_errors.get(name)
            reason = f"keep-float pattern {kept[name]!r}" if name in kept else None
            if reason is None and keep_float_above is not None and error is not None and error > keep_float_above:
                reason = f"error {error:.3g} above {keep_float_above:g}"
            layer_records[name] = {"quantized": reason is None, "error": error, "float_reason": reason}
            static_absmax[name] = input_absmax if scheme.activation == "static" else None
        group_records.append(
            {
                "name": group.name,
                "source": group.source,
                "linears": list(group.linears),
                "alpha": result.alpha,
                "error_before": result.error_before,
                "error_after": result.error_after,
            }
        )

    # Quantize only once every fold is done: the o and down groups fold into v_proj and up_proj rows.
    for name in linear_names:
        if layer_records[name]["quantized"]:
            _quantize(modules[name], static_absmax[name])

    manifest = {
        "quasar_deploy_version": __version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "source": {"path": str(source.path), "architecture": source.spec.architecture, "sha256": source.checkpoint.fingerprint()},
        "recipe": {
            "scheme": scheme.to_dict(),
            "alpha": alpha,
            "alpha_grid": list(smoothing.ALPHA_GRID) if alpha == "auto" else None,
            "num_samples": num_samples,
            "seq_len": seq_len,
            "keep_float": list(keep_float),
            "keep_float_above": keep_float_above,
        },
        "calibration": {
            "data": str(calib_data) if calib_data else "built-in",
            "samples": len(samples),
            "tokens": sum(len(s) for s in samples),
            "fingerprint": data.fingerprint(samples),
        },
        "groups": group_records,
        "layers": layer_records,
        "quantized_layers": [n for n in linear_names if layer_records[n]["quantized"]],
    }
    write_artifact(decoder, source.checkpoint, output, scheme, manifest)
    return open_model(output)


@torch.no_grad()
def _quantize(linear, input_absmax: torch.Tensor | None) -> None:
    wq, w_scale = quantize_weight(linear.weight.data)
    input_scale = None if input_absmax is None else (input_absmax.max().clamp(min=1e-12) / QMAX).reshape(1)
    linear.set_quantized(wq, w_scale, input_scale)


__all__ = ["calibrate"]
