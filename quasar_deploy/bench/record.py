"""The one result record every ``quasar-deploy bench`` subcommand prints with ``--json``, and the page rendered from them.

``bench report`` renders ``docs/benchmarks.md`` from ``bench/results/``, the newest value of each quantity per machine, so
a figure the docs cite names its run and is replaced, not appended to, when measured again."""

from __future__ import annotations

import datetime
import json
import os
import re
from collections.abc import Callable, Iterable
from pathlib import Path

from .._version import __version__
from ..errors import QuasarError
from .anchors import ANCHOR_MODES
from .modes import ADAPTIVE_MODES, k_text

RECORD_VERSION = 1
# set by tools/avx2_view.sh ("avx2"): a record made under the view is of that view of the CPU, and the page keeps it apart
VIEW_ENV = "QUASAR_CPU_VIEW"
VIEW_KEY = "view"
FIELDS = ("record", "command", "options", "version", "date", "machine", "dtypes", "figures")
INT8 = "int8 weights, int8 per-token activations"


def machine() -> dict:
    """The CPU model and the probes the product acts on (ISA flags, kernels, threads), the GPU, and the 1-minute load."""
    from ..doctor import report  # keeps --help torch-free

    info = report()
    keys = ("cpu", "isa", "threads", "omp_wait_policy", "torch", "fbgemm", "onednn", "int8_kernel", "float_kernel", "gpu")
    view = {VIEW_KEY: os.environ[VIEW_ENV]} if os.environ.get(VIEW_ENV) else {}
    return {key: info[key] for key in keys} | {"int8_build": info["probes"]["quasar_int8_build"], "load_1min": os.getloadavg()[0]} | view


def make_record(command: str, options: dict, dtypes: dict[str, str], figures: dict) -> dict:
    """A record of ``figures`` measured just now by ``command`` (e.g. ``bench verify-step``) run with ``options``."""
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return dict(zip(FIELDS, (RECORD_VERSION, command, options, __version__, date, machine(), dtypes, figures)))


def read_records(paths: Iterable[str | Path]) -> list[dict]:
    """The records in ``paths`` (files, or directories of ``*.json``), each checked to be one; a bad one refused in one line."""
    files: list[Path] = []
    for path in map(Path, paths):
        files += sorted(path.glob("*.json")) if path.is_dir() else [path]
    records = []
    for file in files:
        try:
            record = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise QuasarError(f"{file}: not a readable JSON record ({exc.__class__.__name__})") from None
        missing = [f for f in FIELDS if f not in record] if isinstance(record, dict) else list(FIELDS)
        if missing:
            raise QuasarError(f"{file}: not a bench record (no {', '.join(missing)}); write one with `quasar-deploy bench ... --json`")
        records.append(record | {"file": file.name})
    if not records:
        raise QuasarError(f"no records in {', '.join(map(str, paths))}")
    return records


Quantity = tuple[str, str]  # (what was measured, its value as text)


def _head(f: dict) -> str:
    """The dtype a ``bench verify-step`` run's W8A8 model computed its lm_head in."""
    return "int8" if f["int8_lm_head"] else f["head_dtype"]


def _verify_step(f: dict) -> list[Quantity]:
    head = _head(f)
    what = f"verify step, {f['shape']} (synthetic weights), {f['tokens']} tokens on a {f['context']}-token cache, {f['threads']} threads"
    floats = [(f"{what}: float {dtype} ({f['float_kernel']})", f"{ms:.1f} ms") for dtype, ms in f["float_ms"].items()]
    ratio = f"{what}: W8A8 ({head} lm_head) speed-up over the best float, {f['best_float']} (ideal by bytes read {f['ideal_ratio']:.2f}x)"
    return [*floats, (f"{what}: W8A8 ({f['int8_kernel']}, {head} lm_head)", f"{f['w8a8_ms']:.1f} ms"), (ratio, f"{f['ratio']:.2f}x")]


def _e2e(f: dict) -> list[Quantity]:
    s = f["settings"]
    subject = f"synthetic {s['synthetic']}" if s.get("synthetic") else Path(s["artifact"]).name
    what = f"end to end, {subject}, {s['prompt_count']} prompts of {Path(s['prompts']).name}, {s['max_new_tokens']} new tokens"
    rows = []
    # a run that compares drafters (suffix, a k per sequence) is read by its acceptance lengths as much as by its speeds
    drafters_compared = any(mode.startswith("suffix-") or mode in ADAPTIVE_MODES for mode in f["modes"])
    for mode, m in f["modes"].items():
        rows.append((f"{what}: {mode} tokens/s", f"{m['tokens_per_s']:.1f}"))
        if drafters_compared and not mode.startswith("ar-") and m.get("acceptance_length") is not None:
            rows.append((f"{what}: {mode} acceptance length", f"{m['acceptance_length']:.2f}"))
        ours = "w8a8" in mode or mode.startswith("exact-")  # the W8A8 verifier's modes, and exact mode's W8A8 drafting
        if m.get("speedup_vs_best-float") is not None and ours:
            rows.append((f"{what}: {mode} vs the best float mode", f"{m['speedup_vs_best-float']:.2f}x"))
        if m.get("speedup_vs_best_float_at_paper_acceptance") is not None and ours:
            modelled = m["speedup_vs_best_float_at_paper_acceptance"]
            rows.append((f"{what}: {mode} vs the best float mode, modelled at acceptance 1.4", f"{modelled:.2f}x"))
    return rows


def _serve(f: dict) -> list[Quantity]:
    s = f["settings"]
    drafting = f"{s['draft']} drafting" + (f" {k_text(s.get('num_draft'), s['draft'])}" if s["draft"] != "none" else "")
    every_row = "" if s.get("row_budget", False) else ", every drafted row"  # records from before the budget verified every row
    what = f"server, {Path(s['model']).name}, {drafting}{every_row}, {s['max_tokens']} tokens per request"
    ours = f"ours on {f['backend'].split()[0]}"  # the backend the server's startup line named: cpu, onnxruntime, ...
    rows = [_serve_level(f"{what}: {ours}", level) for level in f["levels"]]
    for variant, levels in f.get("compared", {}).items():
        rows += [_serve_level(f"{what}: {ours}, requests drafting {variant}", level) for level in levels]
    if "generate" in f:
        alone = f["generate"]
        label = f"{what}: generate alone on {alone['backend'].split()[0]}, same prompts, in the run of {ours}: output tokens/s"
        rows.append((label, f"{alone['tokens_per_s']:.1f}"))
    if "vllm" in f:
        rows += [_serve_level(f"{what}: vLLM {f['vllm']['version']} (CPU build) serving it", level) for level in f["vllm"]["levels"]]
    return rows


def _serve_level(what: str, level: dict) -> Quantity:
    """One concurrency level: what clients got (output tokens/s) and waited for (the median time to the first token)."""
    ttft = "-" if level["ttft_ms_p50"] is None else f"{level['ttft_ms_p50']:.0f} ms"
    return f"{what}, {level['concurrency']} clients: output tokens/s, TTFT p50", f"{level['tokens_per_s']:.1f}, {ttft}"


def _batched_step(f: dict) -> list[Quantity]:
    what = f"serving step, {Path(f['artifact']).name}, {f['tokens']} rows per sequence on {f['context']}-token caches"
    steps = [(f"{what}: {backend}, {n} sequences", f"{ms:.1f} ms") for backend, by_n in f["ms"].items() for n, ms in by_n.items()]
    piece = f"prefill of a {f.get('prefill_tokens')}-token prompt piece, {Path(f['artifact']).name}"
    return steps + [(f"{piece}: {backend}", f"{ms:.1f} ms") for backend, ms in f.get("prefill_ms", {}).items()]


def _roofline(f: dict) -> list[Quantity]:
    what = f"one generation of {Path(f['model']).name}, {f['draft']} drafting"
    return [
        (f"{what}: tokens/s", f"{f['tokens_per_s']:.1f}"),
        (f"{what}: verify step (bandwidth bound {f['bound_step_ms']:.1f} ms)", f"{f['verify_step_ms']:.1f} ms"),
    ]


def _first_call(f: dict) -> list[Quantity]:
    what = f"{Path(f['path']).name} on {f['backend']}, {f['draft']} drafting"
    return [
        (f"{what}: load", f"{f['load_s']:.1f} s"),
        (f"{what}: first call decode tokens/s", f"{f['decode_tokens_per_s'][0]:.1f}"),
        (f"{what}: first call vs the median of the later ones", f"{f['first_vs_rest']:.2f}x"),
    ]


def _gpu(f: dict) -> list[Quantity]:
    step = f"{f['settings']['tokens']} tokens on a {f['settings']['context']}-token cache"
    rows = [(f"GPU verify step, {v['shape']} (synthetic weights), {step}: W8A8 vs bf16", f"{v['ratio']:.2f}x") for v in f["verify"]]
    return rows + [(f"GPU n-gram end to end, {e['model']} ({e['weights']}): W8A8 vs bf16", f"{e['ratio']:.2f}x") for e in f["e2e"]]


def _kernels(f: dict) -> list[Quantity]:
    float_dtype = f.get("float_dtype", "float32")  # records without it come from before the bench timed the CPU's float dtype
    kernels = f"W8A8 ({f['int8_kernel']}) vs float ({f['float_kernel']}, {float_dtype})"
    what = f"linear kernels, {f['shape']} sizes, {f['threads']} threads, {kernels}"
    return [(f"{what}: {r['out_features']}x{r['in_features']} at M={r['m']}", f"{r['speedup']:.2f}x") for r in f["rows"]]


def _lines(f: dict) -> list[Quantity]:
    """``bench onnx``'s lines: the first says what ran, each later one a label, then two spaces or more or ": ", a figure."""
    what, *rest = (line.strip() for line in f["lines"])
    what = what.split(";")[0]
    rows = []
    for line in rest:
        label, _, value = re.split(r"(\s{2,}|: )", line, maxsplit=1) if re.search(r"\s{2,}|: ", line) else (line, "", "")
        rows.append((f"{what}: {label}", " ".join(value.split())))
    return rows


def _fidelity(f: dict) -> list[Quantity]:
    """``bench onnx fidelity``: its summing-up line (the per-prompt lines stay in the record)."""
    last = f["lines"][-1]
    return [(last.split(":")[0].strip(), last.split(":", 1)[1].strip())]


HEADLINES: dict[str, Callable[[dict], list[Quantity]]] = {
    "bench verify-step": _verify_step,
    "bench e2e": _e2e,
    "bench serve": _serve,
    "bench batched-step": _batched_step,
    "bench roofline": _roofline,
    "bench first-call": _first_call,
    "bench kernels": _kernels,
    "bench gpu": _gpu,
    "bench onnx layers": _lines,
    "bench onnx step": _lines,
    "bench onnx fidelity": _fidelity,
}


def current(records: list[dict]) -> dict[str, dict[str, tuple[str, dict]]]:
    """Per machine (CPU model, or the GPU for ``bench gpu``), per quantity: the newest record's value and that record."""
    table: dict[str, dict[str, tuple[str, dict]]] = {}
    for record in sorted((r for r in records if r["command"] in HEADLINES), key=lambda r: r["date"]):
        for quantity, value in HEADLINES[record["command"]](record["figures"]):
            table.setdefault(_machine_name(record), {})[quantity] = (value, record)
    return table


def _machine_name(record: dict) -> str:
    """The machine the full list files a record under: the GPU for ``bench gpu``, else the CPU model and its view."""
    if record["command"] == "bench gpu":
        return f"GPU: {record['figures']['gpu']}"
    view = record["machine"].get(VIEW_KEY)
    return f"CPU: {record['machine']['cpu']}" + (f", {view} view" if view else "")


def _kind(record: dict) -> str:
    """The summary's machine kind: a CPU's name with the ISA flags it listed (one name covers AVX2-only and AVX-512 kinds)."""
    flags = ", ".join(record["machine"].get("isa") or ())
    return _machine_name(record) + (f" ({flags})" if flags and record["command"] != "bench gpu" else "")


def _e2e_ratio(f: dict) -> str | None:
    """The best of our W8A8 modes against the best float mode (best against best, as the anchors page too), named."""
    ratios = {
        mode: m["speedup_vs_best-float"]
        for mode, m in f["modes"].items()
        if "w8a8" in mode and mode not in ANCHOR_MODES and m.get("speedup_vs_best-float") is not None
    }
    best = max(sorted(ratios), key=ratios.__getitem__, default=None)  # sorted: a tie goes to the first name
    return None if best is None else f"{ratios[best]:.2f}x {best}"


def _verify_ratio(f: dict) -> str:
    """The W8A8 step against the best float step, with the shape and the lm_head's dtype it was timed with."""
    return f"{f['ratio']:.2f}x {f['shape']}, {_head(f)} lm_head"


def _gpu_ratios(entries: list[dict], name: str) -> str | None:
    """A ``bench gpu`` record's W8A8 vs bf16 ratios, one per shape or model it ran (bf16 is the GPU's float)."""
    return "vs bf16: " + ", ".join(f"{e['ratio']:.2f}x {e[name]}" for e in entries) if entries else None


def _serve_tokens_per_s(f: dict) -> dict[int, float]:
    return {level["concurrency"]: level["tokens_per_s"] for level in f["levels"]}


def _serve_scaling(f: dict) -> str | None:
    """Output tokens/s at the most clients the run had over one client's: what batching requests buys."""
    rates = _serve_tokens_per_s(f)
    most = max(rates, default=1)
    if 1 not in rates or most == 1:
        return None
    return f"{rates[most] / rates[1]:.2f}x at {most} clients on {f['backend'].split()[0]}"


def _serve_vs_generate(f: dict) -> str | None:
    """One client's output tokens/s over ``generate`` alone on the same prompts: what serving costs or buys."""
    rates = _serve_tokens_per_s(f)
    if 1 not in rates or "generate" not in f:
        return None
    return f"{rates[1] / f['generate']['tokens_per_s']:.2f}x on {f['backend'].split()[0]}"


def _anchor_modes(f: dict, engine: str) -> str | None:
    """A ``bench e2e`` record's tokens/s of each anchor mode run on ``engine`` (llamacpp, vllm)."""
    ran = [mode for mode in f["modes"] if mode in ANCHOR_MODES and ANCHOR_MODES[mode].engine == engine]
    return ", ".join(f"{f['modes'][mode]['tokens_per_s']:.1f} {mode}" for mode in ran) or None


def _vllm_serving(f: dict) -> str | None:
    """A ``bench serve`` record's vLLM serving the same requests: its output tokens/s at each number of clients."""
    if "vllm" not in f:
        return None
    rates = ", ".join(f"{level['tokens_per_s']:.1f} at {level['concurrency']}" for level in f["vllm"]["levels"])
    return f"vLLM {f['vllm']['version']} serving: {rates} clients"


# the summary's columns: per headline figure, the commands whose records hold it and how each reads it (None: not this one)
SUMMARY: dict[str, dict[str, Callable[[dict], str | None]]] = {
    "end to end: W8A8 vs best float": {"bench e2e": _e2e_ratio, "bench gpu": lambda f: _gpu_ratios(f["e2e"], "model")},
    "verify step: W8A8 vs best float": {"bench verify-step": _verify_ratio, "bench gpu": lambda f: _gpu_ratios(f["verify"], "shape")},
    "serving: most clients vs 1": {"bench serve": _serve_scaling},
    "serving: 1 client vs generate alone": {"bench serve": _serve_vs_generate},
    "llama.cpp tokens/s": {"bench e2e": lambda f: _anchor_modes(f, "llamacpp")},
    "vLLM (CPU build) tokens/s": {"bench e2e": lambda f: _anchor_modes(f, "vllm"), "bench serve": _vllm_serving},
}


def summary(records: list[dict]) -> dict[str, dict[str, tuple[str, dict]]]:
    """Per machine kind, per headline figure: its value in the newest record (by date, then file) holding it, and that record."""
    table: dict[str, dict[str, tuple[str, dict]]] = {}
    for record in sorted(records, key=lambda r: (r["date"], r["file"])):
        row = table.setdefault(_kind(record), {})
        for figure, readers in SUMMARY.items():
            read = readers.get(record["command"])
            value = read(record["figures"]) if read else None
            if value is not None:
                row[figure] = (value, record)
    return table


def _summary_lines(records: list[dict]) -> list[str]:
    """The page's opening table: one row per machine kind, each cell a headline figure and the record it came from."""
    lines = [
        "## Summary",
        "",
        "Per machine kind, each figure from the newest record that holds it (named beside it; — where none does).",
        "",
        "| machine | " + " | ".join(SUMMARY) + " |",
        "|---" * (len(SUMMARY) + 1) + "|",
    ]
    for kind, figures in sorted(summary(records).items()):
        cells = [kind] + [f"{figures[f][0]} (`{figures[f][1]['file']}`)" if f in figures else "—" for f in SUMMARY]
        lines.append("| " + " | ".join(cell.replace("|", "/") for cell in cells) + " |")
    return lines


def _set(options: dict) -> list[tuple[str, object]]:
    """The options a run set (flags off and empty values left out), a path by its last part (only that tells a reader)."""
    return [(k, _last_parts(v)) for k, v in options.items() if v not in (None, False, (), [], "")]


def _last_parts(value: object) -> object:
    """An absolute path (alone, after ``name=``, or in a list) as its file or directory name."""
    if isinstance(value, (list, tuple)):
        return [_last_parts(v) for v in value]
    if isinstance(value, str) and "/" in value:
        name, sep, path = value.rpartition("=") if "=" in value else ("", "", value)
        return f"{name}{sep}{Path(path).name}" if path.startswith(("/", "~")) else value
    return value


def render(records: list[dict]) -> str:
    """``docs/benchmarks.md``: the summary per machine kind, then per machine the current value of every quantity."""
    lines = [
        "# Benchmarks",
        "",
        "Generated by `quasar-deploy bench report bench/results -o docs/benchmarks.md` from the records in `bench/results/`",
        "(each written by the `quasar-deploy bench ... --json` command it names); edit the records, never this page.",
        "A quantity measured again replaces its older value. Ratios are medians of per-pair or per-prompt ratios measured",
        "in one run, so they hold up on a busy machine better than the absolute times, which the load beside them qualifies.",
        "",
        *_summary_lines(records),
    ]
    for kind, quantities in sorted(current(records).items()):
        lines += ["", f"## {kind}", "", "| quantity | value | date | load | version | record |", "|---|---|---|---|---|---|"]
        for quantity, (value, record) in quantities.items():
            load = record["machine"].get("load_1min")
            cells = [quantity, value, record["date"][:10], "-" if load is None else f"{load:.1f}", record["version"], f"`{record['file']}`"]
            lines.append("| " + " | ".join(cell.replace("|", "/") for cell in cells) + " |")
    lines += ["", "## Records", "", "| record | command | options | threads | dtypes |", "|---|---|---|---|---|"]
    for record in sorted(records, key=lambda r: r["file"]):
        options = " ".join(f"{k}={v!r}" if isinstance(v, str) and not v.isprintable() else f"{k}={v}" for k, v in _set(record["options"]))
        dtypes = "; ".join(f"{k}: {v}" for k, v in record["dtypes"].items())
        threads = record["machine"].get("threads") or "not read"  # a GPU run's host CPU may not have been read
        lines.append(f"| `{record['file']}` | `{record['command']}` | {options.replace('|', '/')} | {threads} | {dtypes} |")
    return "\n".join(lines) + "\n"
