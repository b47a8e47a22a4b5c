"""The one result record every ``quasar-deploy bench`` subcommand prints with ``--json``, and the page rendered from them.

A record says what was run (command and options), by which version, on what machine (CPU model, the probes that
choose kernels and backends, the load while it ran), with which dtypes, when, and what it measured (``figures``: the
subcommand's own result). Records are committed under ``bench/results/``; ``quasar-deploy bench report`` renders
``docs/benchmarks.md`` from them, the newest value of each quantity per CPU model, so a figure the docs cite always
names the run it came from and is replaced, not appended to, when it is measured again.
"""

from __future__ import annotations

import datetime
import json
import os
import re
from collections.abc import Callable, Iterable
from pathlib import Path

from ..errors import QuasarError
from .modes import ADAPTIVE_MODES, k_text

RECORD_VERSION = 1
# set by tools/avx2_view.sh ("avx2"): a record made under the view is of that view of the CPU, not of the CPU itself,
# and the page keeps it apart
VIEW_ENV = "QUASAR_CPU_VIEW"
VIEW_KEY = "view"
FIELDS = ("record", "command", "options", "version", "date", "machine", "dtypes", "figures")
INT8 = "int8 weights, int8 per-token activations"


def machine() -> dict:
    """The CPU model and the probes the product acts on (ISA flags, kernels, threads), the GPU, and the 1-minute load."""
    from ..doctor import report

    info = report()
    keys = ("cpu", "isa", "threads", "omp_wait_policy", "torch", "fbgemm", "onednn", "int8_kernel", "float_kernel", "gpu")
    view = {VIEW_KEY: os.environ[VIEW_ENV]} if os.environ.get(VIEW_ENV) else {}
    return {key: info[key] for key in keys} | {"int8_build": info["probes"]["quasar_int8_build"], "load_1min": os.getloadavg()[0]} | view


def make_record(command: str, options: dict, dtypes: dict[str, str], figures: dict) -> dict:
    """A record of ``figures`` measured just now by ``command`` (e.g. ``bench verify-step``) run with ``options``."""
    from .._version import __version__

    return {
        "record": RECORD_VERSION,
        "command": command,
        "options": options,
        "version": __version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "dtypes": dtypes,
        "figures": figures,
    }


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


def _verify_step(f: dict) -> list[Quantity]:
    head = "int8" if f["int8_lm_head"] else f["head_dtype"]
    what = f"verify step, {f['shape']} (synthetic weights), {f['tokens']} tokens on a {f['context']}-token cache, {f['threads']} threads"
    floats = [(f"{what}: float {dtype} ({f['float_kernel']})", f"{ms:.1f} ms") for dtype, ms in f["float_ms"].items()]
    return [
        *floats,
        (f"{what}: W8A8 ({f['int8_kernel']}, {head} lm_head)", f"{f['w8a8_ms']:.1f} ms"),
        (
            f"{what}: W8A8 ({head} lm_head) speed-up over the best float, {f['best_float']} (ideal by bytes read {f['ideal_ratio']:.2f}x)",
            f"{f['ratio']:.2f}x",
        ),
    ]


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
    """Subcommands that report lines of text (``bench onnx``): the first line says what ran; each later one is a
    contender's figure (its label, then two spaces or more, then the figure) or a ``name: value`` line."""
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
    for record in sorted(records, key=lambda r: r["date"]):
        headline = HEADLINES.get(record["command"])
        if headline is None:
            continue
        gpu = record["command"] == "bench gpu"
        view = record["machine"].get(VIEW_KEY)
        kind = f"GPU: {record['figures']['gpu']}" if gpu else f"CPU: {record['machine']['cpu']}" + (f", {view} view" if view else "")
        for quantity, value in headline(record["figures"]):
            table.setdefault(kind, {})[quantity] = (value, record)
    return table


def _set(options: dict) -> list[tuple[str, object]]:
    """The options a run set (flags off and empty values left out), a path by its last part: where it lay on the
    measuring machine says nothing to a reader."""
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
    """``docs/benchmarks.md``: per machine, a table of the current value of every quantity, each naming its record."""
    lines = [
        "# Benchmarks",
        "",
        "Generated by `quasar-deploy bench report bench/results -o docs/benchmarks.md` from the records in `bench/results/`",
        "(each written by the `quasar-deploy bench ... --json` command it names); edit the records, never this page.",
        "A quantity measured again replaces its older value. Ratios are medians of per-pair or per-prompt ratios measured",
        "in one run, so they hold up on a busy machine better than the absolute times, which the load beside them qualifies.",
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
