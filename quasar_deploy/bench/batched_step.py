"""``bench batched-step``: a serving step on each backend that batches, for 1 and for N sequences at once, and a
prompt piece's prefill.

A server's round is one forward over every running sequence's verify block (``BatchVerifyingLM.verify_batch``), and a
new request's first token waits for its prompt's prefill, a piece a round. Backends take turns, each call ``micro.settled``."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import torch
from tqdm import tqdm

from ..artifact import ModelFiles, open_model_files
from ..backends.registry import ONNXRUNTIME_MEMORY_FACTOR, create_backend
from ..errors import QuasarError
from ..memory import estimate, report_tokens
from ..serve.needs import SERVER_NEEDS
from ..speculative.causal_lm import PREFILL_CHUNK, BatchVerifyingLM
from .memory import check_fits
from .micro import settled

BACKENDS = ("cpu", "onnxruntime")
# the layer graphs with ORT's GroupQueryAttention instead of the C kernel (onnxruntime without a kernel build)
GQA_CONTENDER = "onnxruntime-gqa"
CONTENDERS = (*BACKENDS, GQA_CONTENDER)


@dataclass
class BatchedStepResult:
    artifact: str
    sequences: list[int]
    tokens: int
    context: int
    repeats: int
    descriptions: dict[str, str]  # backend -> what ran
    ms: dict[str, dict[str, float]]  # backend -> sequences (as text: JSON keys) -> median ms of the step
    prefill_tokens: int = 0  # a prompt piece's tokens (0: not timed)
    prefill_ms: dict[str, float] = field(default_factory=dict)  # backend -> median ms of that piece's prefill

    def to_dict(self) -> dict:
        return asdict(self)


def serving_lm(backend: str, files: ModelFiles) -> BatchVerifyingLM:
    """What ``serve --backend BACKEND`` steps: the model as it serves (``needs`` of the server), which must batch."""
    if backend == GQA_CONTENDER:
        from ..backends.onnx_layered import load_layered  # optional: onnx, onnxruntime

        return load_layered(files, progress=False, attention="ort")
    lm = create_backend(backend, files, SERVER_NEEDS)
    if not isinstance(lm, BatchVerifyingLM):
        raise QuasarError(f"backend {backend!r} serves {files.path.name} round-robin: it has no batched step to time")
    return lm


def batched_step(
    artifact: str,
    sequences: Sequence[int] = (1, 8),
    tokens: int = 6,
    context: int = 150,
    repeats: int = 10,
    backends: Sequence[str] = BACKENDS,
    progress: bool = True,
    prefill: int = PREFILL_CHUNK,
) -> BatchedStepResult:
    """Each backend's ``verify_batch`` of ``n`` x ``tokens`` rows for each ``n`` of ``sequences``, and a ``prefill`` piece."""
    if not 0 <= prefill <= PREFILL_CHUNK:
        raise QuasarError(f"a prefill piece is 0 to {PREFILL_CHUNK} tokens (a server round's), not {prefill}")

    files = open_model_files(artifact)
    one = estimate(files).total(report_tokens(files.spec))
    check_fits(one * (len(backends) + ONNXRUNTIME_MEMORY_FACTOR - 1), f"bench batched-step of {len(backends)} backends")
    widest = max(sequences)
    generator = torch.Generator().manual_seed(0)
    vocab = files.spec.vocab_size
    prompts = [torch.randint(0, vocab, (context,), generator=generator).tolist() for _ in range(widest)]
    blocks = [torch.randint(0, vocab, (tokens,), generator=generator).tolist() for _ in range(widest)]
    piece = torch.randint(0, vocab, (prefill,), generator=generator).tolist()
    models, opened, fresh = {}, {}, {}
    for backend in backends:
        lm = models[backend] = serving_lm(backend, files)
        opened[backend] = [lm.new_sequence() for _ in range(widest)]
        fresh[backend] = lm.new_sequence()
        for sequence, prompt in zip(opened[backend], prompts):
            sequence.prefill(prompt)

    def step(lm: BatchVerifyingLM, seqs: list, rows: list, *flags: list[bool], length: int) -> float:
        start = time.perf_counter()
        lm.verify_batch(seqs, rows, *flags)
        elapsed = time.perf_counter() - start
        for sequence in seqs:
            sequence.truncate(length)
        return elapsed

    times: dict[str, dict[int, list[float]]] = {b: {n: [] for n in sequences} for b in backends}
    prefills: dict[str, list[float]] = {b: [] for b in backends}
    for _ in tqdm(range(repeats), desc="batched steps", disable=not progress):
        for backend in backends:
            for n in sequences:
                times[backend][n].append(settled(partial(step, models[backend], opened[backend][:n], blocks[:n], length=context)))
            if prefill:
                prefills[backend].append(settled(partial(step, models[backend], [fresh[backend]], [piece], [True], length=0)))
    return BatchedStepResult(
        artifact=str(artifact),
        sequences=list(sequences),
        tokens=tokens,
        context=context,
        repeats=repeats,
        descriptions={b: models[b].description for b in backends},
        ms={b: {str(n): 1000 * statistics.median(t) for n, t in by_n.items()} for b, by_n in times.items()},
        prefill_tokens=prefill,
        prefill_ms={b: 1000 * statistics.median(t) for b, t in prefills.items() if t},
    )


def describe(result: BatchedStepResult) -> str:
    first, widest = str(min(result.sequences)), str(max(result.sequences))
    lines = [
        f"batched verify step, {Path(result.artifact).name}: {result.tokens} tokens per sequence on a {result.context}-token cache, "
        f"median of {result.repeats}"
    ]
    for backend, by_n in result.ms.items():
        steps = ", ".join(f"{n} x {result.tokens} rows {ms:.1f} ms" for n, ms in by_n.items())
        lines.append(f"{backend} ({result.descriptions[backend]}): {steps}; {widest} over {first}: {by_n[widest] / by_n[first]:.2f}x")
    if len(result.ms) > 1:
        base, *others = result.ms
        for other in others:
            ratios = ", ".join(f"{result.ms[base][n] / result.ms[other][n]:.2f}x at {n}" for n in result.ms[base])
            lines.append(f"{other} vs {base}: {ratios}")
    if result.prefill_ms:
        pieces = ", ".join(f"{backend} {ms:.1f} ms" for backend, ms in result.prefill_ms.items())
        lines.append(f"prefill of a {result.prefill_tokens}-token prompt piece (one server round's), a fresh sequence: {pieces}")
    return "\n".join(lines)
