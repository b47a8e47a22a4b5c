"""Writing a benchmark report: report.json (every figure), report.md (the table) and PNG plots."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import QuasarError
from .modes import k_text


def _fmt(value, spec: str = ".2f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def markdown(report: dict) -> str:
    s = report["settings"]
    source = f"synthetic {s['synthetic']} (synthetic weights)" if s.get("synthetic") else f"{s['model']} / {s['artifact']}"
    lines = [
        "# quasar-deploy benchmark",
        "",
        f"Model: {source}. Prompts: {s['prompt_count']} from {s['prompts']}. "
        f"{s['max_new_tokens']} new tokens, temperature {s['temperature']}, {k_text(s['num_draft'])}, "
        f"n-gram {s['ngram_min']}..{s['ngram_max']}. "
        f"CPU: {report['environment']['cpu']}, {report['environment']['threads']} threads. "
        f"Float modes on our engine compute in {s.get('float_dtype', 'float32')}; -ort float modes in float32.",
        "",
        "| mode | tokens/s median (min-max) | acceptance length | verify step ms | draft / verify share | vs ngram-float | vs ar-float "
        "| vs best float | vs best float at L=1.4 |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for mode, m in report["modes"].items():
        share = m["time_share"]
        share_text = f"{100 * share['draft']:.0f}% / {100 * share['verify']:.0f}%" if share else "-"
        lines.append(
            f"| {mode} | {m['tokens_per_s']:.1f} ({m['tokens_per_s_min']:.1f}-{m['tokens_per_s_max']:.1f}) | "
            f"{_fmt(m['acceptance_length'])} | {_fmt(m['verify_step_ms'], '.1f')} | {share_text} | "
            f"{_fmt(m.get('speedup_vs_ngram-float'), '.2f', 'x')} | {_fmt(m.get('speedup_vs_ar-float'), '.2f', 'x')} | "
            f"{_fmt(m.get('speedup_vs_best-float'), '.2f', 'x')} | {_fmt(m.get('speedup_vs_best_float_at_paper_acceptance'), '.2f', 'x')} |"
        )
    if "lossless" in report:
        lines += ["", "Lossless check (greedy; identical tokens on every prompt):", ""]
        lines += [f"- {pair}: {'yes' if ok else 'NO'}" for pair, ok in report["lossless"].items()]
    if report.get("sweep_k"):
        lines += [
            "",
            "| k | ngram-float tok/s | ngram-w8a8 tok/s | speed-up | acceptance length (w8a8) |",
            "| --- | --- | --- | --- | --- |",
        ]
        for row in report["sweep_k"]:
            lines.append(
                f"| {row['k']} | {row['ngram_float_tokens_per_s']:.1f} | {row['ngram_w8a8_tokens_per_s']:.1f} | "
                f"{row['speedup']:.2f}x | {row['acceptance_length_w8a8']:.2f} |"
            )
    lines += _exact_lines(report)
    lines += _anchor_lines(report)
    if s.get("timed_in_own_phase"):
        lines += ["", f"Timed in a phase of their own before the others (not interleaved): {', '.join(s['timed_in_own_phase'])}."]
    lines += [
        "",
        "At L=1.4: each speculative mode's speed modelled at the acceptance length the Quasar paper measured on real chat "
        "(1.33-1.40), from its measured step cost (verify + draft), against the best float mode modelled alike.",
    ]
    if s.get("synthetic"):
        lines += ["", "Synthetic weights: timing only. Random models loop, so n-gram acceptance here says nothing about real text."]
    return "\n".join(lines) + "\n"


def _exact_lines(report: dict) -> list[str]:
    """Exact mode's measured step costs (C a float step, c a W8A8 round) and what its adaptive choice made of them."""
    exact = {mode: m for mode, m in report["modes"].items() if "middle_rounds_per_step" in m}
    if not exact:
        return []
    lines = [
        "",
        "| exact mode | float step C ms | W8A8 round c ms | c/C | W8A8 rounds per float step | float steps at r = 0 "
        "| float acceptance of W8A8 tokens | at L=1.4: rounds, gain over float n-gram |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for mode, m in exact.items():
        c, big_c = m["middle_round_ms"], m["verify_step_ms"]
        gain = m.get("gain_over_float_ngram_at_paper_acceptance")
        at_paper = f"{m['rounds_at_paper_acceptance']}, {gain:.2f}x" if gain is not None else "-"
        lines.append(
            f"| {mode} | {_fmt(big_c, '.1f')} | {_fmt(c, '.1f')} | {_fmt(c / big_c if c and big_c else None)} | "
            f"{m['middle_rounds_per_step']:.2f} | {100 * m['direct_step_share']:.0f}% | "
            f"{_fmt(m.get('float_acceptance_of_w8a8_tokens'), '.3f')} | {at_paper} |"
        )
    lines += [
        "",
        'Exact mode at L=1.4: its own speed model (docs/architecture.md, "Exact mode") from the costs and acceptance measured '
        "above, at the paper's acceptance: the W8A8 rounds it would choose and their gain over plain float n-gram verification.",
    ]
    return lines


def _anchor_lines(report: dict) -> list[str]:
    """The anchors' table (other engines, greedy, batch 1, same prompts) and why any anchor was skipped."""
    lines = []
    if report.get("anchors"):
        lines += [
            "",
            "Anchors (other CPU engines, each in its own process; greedy token matches are informational: different numerics):",
            "",
            "| mode | engine | tokens/s median | our best W8A8 / it | tokens matching our float (share, mean prefix) "
            "| matching our W8A8 | what it computes |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for mode, a in report["anchors"].items():
            match = [a.get(f"tokens_matching_{name}") for name in ("float", "w8a8")]
            cells = ["-" if m is None else f"{100 * m['share']:.0f}%, {m['mean_common_prefix']:.1f}" for m in match]
            lines.append(
                f"| {mode} | {a['engine']} {a['version']} | {report['modes'][mode]['tokens_per_s']:.1f} | "
                f"{_fmt(a['best_w8a8_vs_it'], '.2f', 'x')} | {cells[0]} | {cells[1]} | {a['numerics']} |"
            )
    if report.get("skipped"):
        lines += ["", "Skipped:", ""] + [f"- {reason}" for reason in report["skipped"].values()]
    return lines


def pyplot():
    """matplotlib's pyplot drawing to files; without matplotlib (the ``bench`` extra), a one-line refusal saying how to get it."""
    try:
        import matplotlib  # optional: matplotlib (the bench extra)
    except ImportError:
        raise QuasarError("the report's plots need matplotlib: pip install 'quasar-deploy[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional: matplotlib (the bench extra)

    return plt


def plots(report: dict, out: Path) -> list[Path]:
    plt = pyplot()
    written = []
    modes = list(report["modes"])
    figures = report["modes"]

    def save(fig, name: str) -> None:
        fig.tight_layout()
        written.append(out / name)
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)

    fig, ax = plt.subplots(figsize=(9, 4))
    medians = [figures[m]["tokens_per_s"] for m in modes]
    low = [medians[i] - figures[m]["tokens_per_s_min"] for i, m in enumerate(modes)]
    high = [figures[m]["tokens_per_s_max"] - medians[i] for i, m in enumerate(modes)]
    ax.bar(modes, medians, yerr=[low, high], capsize=4, color=["#4c72b0" if "w8a8" in m else "#999999" for m in modes])
    ax.set(ylabel="tokens/s (median, min-max)", title="Decoding speed per mode")
    ax.tick_params(axis="x", rotation=30)
    save(fig, "tokens_per_s.png")

    drafting = [m for m in modes if figures[m]["acceptance_length"] is not None and not m.startswith("ar-")]
    if drafting:
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.hist([figures[m]["acceptance_lengths"] for m in drafting], label=drafting, bins=10)
        ax.set(xlabel="acceptance length per prompt (tokens per verify step)", ylabel="prompts")
        ax.legend()
        save(fig, "acceptance_length.png")

    if report.get("sweep_k"):
        rows = report["sweep_k"]
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot([r["k"] for r in rows], [r["speedup"] for r in rows], marker="o")
        ax.set(xlabel="draft length k", ylabel="ngram-w8a8 / ngram-float tokens/s")
        ax.axhline(1.0, color="#999999", linewidth=1)
        save(fig, "speedup_vs_k.png")
    return written


def write(report: dict, out: str | Path) -> list[Path]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    (out / "report.md").write_text(markdown(report))
    return [out / "report.json", out / "report.md", *plots(report, out)]
