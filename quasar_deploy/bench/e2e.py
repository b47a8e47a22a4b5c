"""End-to-end benchmark: every decoding mode on the same prompts, interleaved prompt by prompt, in one process.

Modes take turns on each prompt, so speed-ups are medians of per-prompt ratios measured seconds apart, whatever the drift;
transformers' prompt lookup and the anchors each run first in a phase of their own (the report's ``timed_in_own_phase``)."""

from __future__ import annotations

import gc
import json
import platform
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from operator import attrgetter
from pathlib import Path
from typing import TypeVar

import tokenizers
import torch
from tqdm import tqdm

from ..backends.torch_backend import TorchCausalLM
from ..cache import cache_dir
from ..cpu.linears import default_float_dtype, dtype_name
from ..doctor import report as doctor_report
from ..engine import GenerationStats
from ..errors import QuasarError
from ..memory import return_freed_memory
from ..speculative.cascade import CascadeStats, RoundPolicy
from ..speculative.registry import default_num_draft
from . import anchors
from .contenders import Contenders
from .modes import ADAPTIVE_MODES, ALL_MODES, EXACT_MODES, LOSSLESS_PAIRS, ORT_MODES, drafter_and_precision, ort_precisions

T = TypeVar("T")


@dataclass
class BenchSettings:
    prompts: str
    model: str | None = None
    artifact: str | None = None
    synthetic: str | None = None
    limit: int = 10
    repeats: int = 1  # runs of each mode on each prompt; its median run stands for the prompt
    max_new_tokens: int = 128
    temperature: float = 0.0
    num_draft: int | None = None  # None: each drafter's own (speculative.registry)
    ngram_min: int = 1
    ngram_max: int = 3
    suffix_min_prob: float = 0.1
    skip_fraction: float = 0.5
    prune_fraction: float = 0.25
    seed: int = 0
    modes: Sequence[str] = ALL_MODES
    sweep_k: Sequence[int] = ()
    anchor_pythons: Mapping[str, str] = field(default_factory=dict)  # engine -> python of its venv (``anchors.pythons``)


@dataclass
class Run:
    """One mode on one prompt. ``stats`` is the engine's record of its decode loop; transformers' prompt lookup keeps none."""

    tokens: list[int]
    tokens_per_s: float
    wall_s: float
    stats: GenerationStats | None = None


def read_prompts(path: str | Path, limit: int) -> list[str]:
    """Spec-Bench JSONL (``turns[0]`` is the prompt)."""
    path = Path(path)
    if not path.is_file():
        raise QuasarError(f"{path}: no such prompt file")
    prompts = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            turns = json.loads(line)["turns"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise QuasarError(f"{path}:{number}: expected a JSON object with a 'turns' list (Spec-Bench format)") from None
        prompts.append(turns[0])
        if len(prompts) == limit:
            break
    if not prompts:
        raise QuasarError(f"{path}: no prompts")
    return prompts


class PrunedLM:
    """A float verifier with decoder layers removed: the paper's structural-pruning comparison."""

    def __init__(self, lm: TorchCausalLM, removed: frozenset[int]):
        self.lm, self.removed = lm, removed
        self.vocab_size, self.max_length = lm.vocab_size, lm.max_length

    def prefill(self, ids):
        self.lm.truncate(0)
        return self.lm.verify_skipping(ids, self.removed)[-1]

    def verify(self, ids):
        return self.lm.verify_skipping(ids, self.removed)

    def truncate(self, length: int) -> None:
        self.lm.truncate(length)

    @property
    def length(self) -> int:
        return self.lm.length


_DRAFTER_SETTINGS = {"ngram": ("ngram_min", "ngram_max"), "suffix": ("suffix_min_prob",), "layerskip": ("skip_fraction",)}


def _engine_run(engine, ids: list[int], settings: BenchSettings, draft: str, **extra) -> Run:
    options = dict(max_new_tokens=settings.max_new_tokens, temperature=settings.temperature, seed=settings.seed, draft=draft)
    if draft != "none":
        k = extra.pop("num_draft", settings.num_draft)
        if k is not None:
            options["num_draft"] = k
        options["adaptive_k"] = extra.pop("adaptive_k", False)
    options.update({name: getattr(settings, name) for name in _DRAFTER_SETTINGS.get(draft, ())})
    result = engine.generate(ids, **options)
    return Run(result.tokens, result.stats.tokens_per_s, result.stats.wall_s, result.stats)


def _hf_run(model, ids: list[int], settings: BenchSettings, eos: list[int]) -> Run:
    inputs = torch.tensor([ids])
    lookup = settings.num_draft or default_num_draft("ngram")
    kwargs = dict(max_new_tokens=settings.max_new_tokens, prompt_lookup_num_tokens=lookup, eos_token_id=eos, pad_token_id=eos[0])
    if settings.temperature > 0:
        kwargs.update(do_sample=True, temperature=settings.temperature, top_k=0)
        torch.manual_seed(settings.seed)
    else:
        kwargs.update(do_sample=False)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(inputs, **kwargs)
    wall = time.perf_counter() - start
    tokens = out[0, len(ids) :].tolist()
    return Run(tokens, len(tokens) / wall if wall > 0 else 0.0, wall)


def hf_phase(contenders: Contenders, encoded: list[list[int]], settings: BenchSettings, progress: bool) -> list[Run]:
    """transformers' prompt lookup on every prompt, its model loaded, run and freed before the engines load (peak memory)."""
    model = contenders.load_hf()
    eos = sorted(contenders.stop_ids) or [0]
    _hf_run(model, encoded[0], BenchSettings(**{**asdict(settings), "max_new_tokens": 4}), eos)  # one-time costs
    runs = [_hf_run(model, ids, settings, eos) for ids in tqdm(encoded, desc="hf-prompt-lookup", unit="prompt", disable=not progress)]
    del model
    gc.collect()
    return_freed_memory()
    return runs


def run_mode(mode: str, contenders: Contenders, ids: list[int], settings: BenchSettings) -> Run:
    if mode in EXACT_MODES:
        return _engine_run(contenders.exact_engine(EXACT_MODES[mode]), ids, settings, "ngram")
    if mode in ORT_MODES:
        drafter, precision = drafter_and_precision(mode)
        return _engine_run(contenders.ort_engines[precision], ids, settings, drafter)
    if mode == "pruned-verify":
        engine = contenders.float_engine
        pruned = type(engine)(PrunedLM(engine.lm, contenders.pruned_layers), engine.tokenizer, engine.stop_ids, engine.backend)
        return _engine_run(pruned, ids, settings, "ngram")
    drafter, precision = drafter_and_precision(mode)
    engine = contenders.float_engine if precision == "float" else contenders.w8a8_engine
    return _engine_run(engine, ids, settings, drafter, adaptive_k=mode in ADAPTIVE_MODES)


def median_run(attempts: Sequence[T], speed: Callable[[T], float] = attrgetter("tokens_per_s")) -> T:
    """The whole run (tokens, time, statistics) of median ``speed`` among repeats (the slower middle one of an even count)."""
    return sorted(attempts, key=speed)[(len(attempts) - 1) // 2]


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _summary(runs: list[Run], baseline: dict[str, list[Run]]) -> dict:
    tps = [r.tokens_per_s for r in runs]
    loops = [r.stats for r in runs if r.stats is not None]
    steps = sum(s.verify_steps for s in loops)
    wall = sum(r.wall_s for r in runs)
    figures = {
        "tokens_per_s": statistics.median(tps),
        "tokens_per_s_min": min(tps),
        "tokens_per_s_max": max(tps),
        "acceptance_length": statistics.mean(s.acceptance_length for s in loops) if loops else None,
        "acceptance_lengths": [r.stats.acceptance_length if r.stats else None for r in runs],
        "verify_step_ms": 1000 * sum(s.verify_s for s in loops) / steps if steps else None,
        "time_share": {
            "prefill": sum(s.prefill_s for s in loops) / wall,
            "draft": sum(s.draft_s for s in loops) / wall,
            "verify": sum(s.verify_s for s in loops) / wall,
            "overhead": max(0.0, 1 - sum(s.prefill_s + s.draft_s + s.verify_s for s in loops) / wall),
        }
        if steps
        else None,
        "new_tokens": sum(len(r.tokens) for r in runs),
        **_cascade_figures(loops),
    }
    for name, base in baseline.items():
        figures[f"speedup_vs_{name}"] = _median([r.tokens_per_s / b.tokens_per_s for r, b in zip(runs, base) if b.tokens_per_s > 0])
    if steps:  # a verify step and its draft without the prefill, whatever they accept
        figures["step_ms"] = 1000 * sum(s.verify_s + s.draft_s for s in loops) / steps
        figures["tokens_per_s_at_paper_acceptance"] = PAPER_ACCEPTANCE / (figures["step_ms"] / 1000) if figures["step_ms"] else None
    return figures


# every speculative mode is also modelled at the Quasar paper's n-gram acceptance on real chat (1.33-1.40): code accepts more
PAPER_ACCEPTANCE = 1.4


def _at_paper_acceptance(figures: dict[str, dict], float_modes: list[str]) -> None:
    """Each mode's speed-up over the best float mode, all modelled at ``PAPER_ACCEPTANCE`` (autoregressive ones as measured)."""

    def modelled(m: dict) -> float | None:
        return m.get("tokens_per_s_at_paper_acceptance") if (m.get("acceptance_length") or 1.0) > 1.0 else m["tokens_per_s"]

    floats = [v for v in (modelled(figures[m]) for m in float_modes) if v]
    if not floats:
        return
    for m in figures.values():
        if m.get("acceptance_length") is not None:  # else another engine (an anchor, transformers): its step cost is unknown
            value = modelled(m)
            m["speedup_vs_best_float_at_paper_acceptance"] = value / max(floats) if value else None


def _exact_at_paper_acceptance(figures: dict, policy: RoundPolicy, plain: dict | None) -> None:
    """Exact mode at ``PAPER_ACCEPTANCE`` by its own speed model (``RoundPolicy.gain_at``), against ``plain`` float n-gram."""
    modelled = policy.gain_at(PAPER_ACCEPTANCE)
    if modelled is None:
        return
    rounds, gain = modelled
    figures.update(rounds_at_paper_acceptance=rounds, gain_over_float_ngram_at_paper_acceptance=gain)
    figures["float_acceptance_of_w8a8_tokens"] = policy.acceptance
    base = plain.get("tokens_per_s_at_paper_acceptance") if plain else None
    figures["tokens_per_s_at_paper_acceptance"] = gain * (base or PAPER_ACCEPTANCE / policy.verify_cost(1 + policy.proposal_length))


def _cascade_figures(loops: list[GenerationStats]) -> dict:
    """Exact mode's W8A8 round time (c; the float step's C is ``verify_step_ms``), rounds per float step, share at r = 0."""
    cascades = [s.loop for s in loops if isinstance(s.loop, CascadeStats)]
    rounds = sum(s.middle_rounds for s in cascades)
    steps = sum(s.verify_steps for s in cascades)
    if not steps:
        return {}
    return {
        "middle_round_ms": 1000 * sum(s.middle_s for s in cascades) / rounds if rounds else None,
        "middle_rounds_per_step": rounds / steps,
        "direct_step_share": sum(s.direct_steps for s in cascades) / steps,
    }


def _agreement(runs: list[Run], reference: list[Run]) -> float:
    """Share of the float model's greedy tokens reproduced at the same position."""
    return anchors.token_match([r.tokens for r in runs], [r.tokens for r in reference])["share"]


def environment() -> dict:
    import transformers  # heavy: transformers, read here for its version only

    info = doctor_report()
    info.update(transformers=transformers.__version__, tokenizers=tokenizers.__version__, platform=platform.platform())
    return info


def benchmark(settings: BenchSettings, contenders: Contenders, progress: bool = True) -> dict:
    """Run every mode on every prompt (interleaved); return the report (JSON-ready)."""
    unknown = [m for m in settings.modes if m not in ALL_MODES]
    if unknown:
        raise QuasarError(f"unknown mode {unknown[0]!r}; choose from {', '.join(ALL_MODES)}")
    modes = [m for m in settings.modes if m != "hf-prompt-lookup" or contenders.load_hf is not None]
    modes = [m for m in modes if m not in ORT_MODES or set(ort_precisions(m)) <= set(contenders.ort_engines)]
    prompts = read_prompts(settings.prompts, settings.limit)
    encoded = [list(contenders.tokenizer.encode(p)) for p in prompts]
    anchor_results, skipped = _anchor_phase([m for m in modes if m in anchors.ANCHOR_MODES], settings, contenders, encoded)
    modes = [m for m in modes if m not in skipped]
    runs: dict[str, list[Run]] = {m: [] for m in modes}
    for mode, result in anchor_results.items():
        runs[mode] = [Run(r.tokens, len(r.tokens) / r.wall_s, r.wall_s) for r in result.runs]
    if "hf-prompt-lookup" in runs:
        runs["hf-prompt-lookup"] = hf_phase(contenders, encoded, settings, progress)
    interleaved = [m for m in modes if m != "hf-prompt-lookup" and m not in anchors.ANCHOR_MODES]
    if "pruned-verify" in interleaved and not contenders.pruned_layers:
        contenders.pruned_layers = contenders.float_engine.choose_skip_layers(settings.prune_fraction)
    warm = BenchSettings(**{**asdict(settings), "max_new_tokens": 4})
    for mode in interleaved:  # first calls pay one-time costs (weight packing, allocator); keep them out of the figures
        run_mode(mode, contenders, encoded[0], warm)
    for i, ids in enumerate(tqdm(encoded if interleaved else [], desc="benchmark", unit="prompt", disable=not progress)):
        tried: dict[str, list[Run]] = {m: [] for m in interleaved}
        for repeat in range(settings.repeats):
            turn = (i + repeat) % len(interleaved)
            for mode in interleaved[turn:] + interleaved[:turn]:
                tried[mode].append(run_mode(mode, contenders, ids, settings))
        for mode, attempts in tried.items():
            runs[mode].append(median_run(attempts))
    baselines = {m: runs[m] for m in ("ngram-float", "ar-float") if m in runs}
    ours = [m for m in runs if m not in anchors.ANCHOR_MODES]
    float_modes = [m for m in ours if "w8a8" not in m and m != "pruned-verify" and m not in EXACT_MODES]
    if float_modes:  # the fastest float path on each prompt, whichever engine it is
        baselines["best-float"] = [max((runs[m][i] for m in float_modes), key=lambda r: r.tokens_per_s) for i in range(len(encoded))]
    report = {
        "settings": {
            **asdict(settings),
            "modes": modes,
            "weights": contenders.weights,
            "prompt_count": len(prompts),
            "timed_in_own_phase": [m for m in modes if m not in interleaved],
        },
        "environment": environment(),
        "modes": {m: _summary(r, baselines) for m, r in runs.items()},
    }
    for mode in [m for m in runs if m in EXACT_MODES]:
        plain = report["modes"].get("ngram-float-ort" if EXACT_MODES[mode] == "ort" else "ngram-float")
        _exact_at_paper_acceptance(report["modes"][mode], contenders.exact_engine(EXACT_MODES[mode]).round_policy(), plain)
    _at_paper_acceptance(report["modes"], float_modes)
    report["settings"]["float_dtype"] = dtype_name(default_float_dtype("cpu"))
    if anchor_results:
        report["anchors"] = _anchor_report(anchor_results, runs, [m for m in ours if "w8a8" in m])
    if skipped:
        report["skipped"] = skipped
    if contenders.pruned_layers:
        report["settings"]["pruned_layers"] = sorted(contenders.pruned_layers)
    if settings.temperature == 0:
        report["lossless"] = {
            f"{a} == {b}": all(x.tokens == y.tokens for x, y in zip(runs[a], runs[b])) for a, b in LOSSLESS_PAIRS if a in runs and b in runs
        }
        if "ar-float" in runs:
            for mode in runs:
                report["modes"][mode]["agreement_with_ar_float"] = _agreement(runs[mode], runs["ar-float"])
    if settings.sweep_k:
        report["sweep_k"] = sweep_k(settings, contenders, encoded, progress)
    return report


def _anchor_phase(
    modes: list[str], settings: BenchSettings, contenders: Contenders, encoded: list[list[int]]
) -> tuple[dict[str, anchors.AnchorResult], dict[str, str]]:
    """The anchor modes, each in its own engine's process, before our engines load; the same greedy settings, batch 1."""
    if not modes:
        return {}, {}
    if settings.temperature > 0:
        return {}, {m: f"{m}: anchors run greedy only (temperature 0)" for m in modes}
    paths = (Path(settings.model), Path(settings.artifact)) if settings.model and settings.artifact else None
    options = dict(
        max_new_tokens=settings.max_new_tokens,
        threads=torch.get_num_threads(),
        num_draft=settings.num_draft or default_num_draft("ngram"),
        ngram=(settings.ngram_min, settings.ngram_max),
    )
    configured = anchors.pythons(settings.anchor_pythons)
    return anchors.anchor_phase(modes, paths, encoded, sorted(contenders.stop_ids), configured, options, cache_dir() / "anchors")


def _anchor_report(results: dict[str, anchors.AnchorResult], runs: dict[str, list[Run]], w8a8_modes: list[str]) -> dict:
    """Per anchor: engine, version, numerics, our best W8A8 mode over it (per-prompt median) and how its tokens follow ours."""
    references = {name: next((m for m in candidates if m in runs), None) for name, candidates in _REFERENCES.items()}
    report = {}
    for mode, result in results.items():
        mine = runs[mode]
        entry = {
            "engine": result.engine,
            "version": result.version,
            "numerics": anchors.ANCHOR_MODES[mode].numerics,
            "details": result.details,
            "best_w8a8_modes": w8a8_modes,
            "best_w8a8_vs_it": _median(
                [max(runs[m][i].tokens_per_s for m in w8a8_modes) / run.tokens_per_s for i, run in enumerate(mine) if run.tokens_per_s > 0]
            )
            if w8a8_modes
            else None,
        }
        for name, reference in references.items():
            if reference is not None:
                entry[f"tokens_matching_{name}"] = {
                    "reference": reference,
                    **anchors.token_match([r.tokens for r in mine], [r.tokens for r in runs[reference]]),
                }
        report[mode] = entry
    return report


# our greedy outputs an anchor's tokens are compared with: the first of each list that ran (drafting is lossless)
_REFERENCES = {"float": ("ar-float", "ngram-float"), "w8a8": ("ar-w8a8", "ngram-w8a8")}


def sweep_k(settings: BenchSettings, contenders: Contenders, encoded: list[list[int]], progress: bool) -> list[dict]:
    rows = []
    for k in tqdm(settings.sweep_k, desc="sweep k", disable=not progress):
        engines = (contenders.float_engine, contenders.w8a8_engine)
        pairs = [[_engine_run(engine, ids, settings, "ngram", num_draft=k) for engine in engines] for ids in encoded]
        rows.append(
            {
                "k": k,
                "ngram_float_tokens_per_s": statistics.median(f.tokens_per_s for f, _ in pairs),
                "ngram_w8a8_tokens_per_s": statistics.median(q.tokens_per_s for _, q in pairs),
                "speedup": statistics.median(q.tokens_per_s / f.tokens_per_s for f, q in pairs),
                "acceptance_length_w8a8": statistics.mean(q.stats.acceptance_length for _, q in pairs),
            }
        )
    return rows
