"""How closely a W8A8 artifact follows its float model, on held-out text.

Speculative decoding is lossless with respect to the W8A8 verifier, not the float model, so fidelity is measured."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from .artifact import ModelFiles, open_model_files
from .calibration import calibrate, data
from .cpu.choice import default_int8_kernel
from .cpu.linears import default_float_dtype, default_float_kernel
from .errors import QuasarError
from .tokenizer import load_tokenizer


@dataclass
class Fidelity:
    tokens: int
    top1_agreement: float  # share of positions where both models predict the same next token
    mean_kl: float  # mean KL(float || W8A8) over positions, nats
    ppl_float: float
    ppl_w8a8: float

    def to_dict(self) -> dict:
        return asdict(self)


def evaluate(
    artifact: str | Path,
    reference: str | Path,
    eval_data: str | Path | None = None,
    num_samples: int = 32,
    seq_len: int = 256,
    progress: bool = True,
) -> Fidelity:
    quantized_files = open_model_files(artifact)
    float_files = open_model_files(reference)
    if not quantized_files.is_artifact:
        raise QuasarError(f"{quantized_files.path}: not a W8A8 artifact (no quasar.json); calibrate it first")
    if float_files.is_artifact:
        raise QuasarError(f"{float_files.path}: --reference must be the float checkpoint, not an artifact")
    if float_files.spec.vocab_size != quantized_files.spec.vocab_size:
        raise QuasarError("the artifact and the reference have different vocabularies")
    tokenizer = load_tokenizer(float_files, trust_remote_code=False)
    samples = data.token_samples(tokenizer, data.read_texts(eval_data, default="eval"), num_samples, seq_len)
    float_model = float_files.decoder()  # the reference: float32, the most precise float the CPU backend has
    float_model.prepare(default_float_kernel(), default_int8_kernel())
    quant_model = quantized_files.decoder(head_dtype=default_float_dtype("cpu"))  # as load_cpu runs it
    quant_model.prepare(default_float_kernel(), default_int8_kernel())

    agree = kl = nll_float = nll_quant = 0.0
    count = 0
    for ids in tqdm(samples, desc="evaluating", unit="sample", disable=not progress):
        tokens = torch.tensor(ids, dtype=torch.long)
        logp_f = F.log_softmax(float_model(tokens, float_model.new_cache(len(ids))), dim=-1)
        logp_q = F.log_softmax(quant_model(tokens, quant_model.new_cache(len(ids))), dim=-1)
        targets = tokens[1:]
        agree += float((logp_f.argmax(-1) == logp_q.argmax(-1)).sum())
        kl += float((logp_f.exp() * (logp_f - logp_q)).sum())
        nll_float -= float(logp_f[:-1].gather(1, targets[:, None]).sum())
        nll_quant -= float(logp_q[:-1].gather(1, targets[:, None]).sum())
        count += len(ids)
    predicted = count - len(samples)
    ppl_float = math.exp(nll_float / predicted)
    ppl_w8a8 = math.exp(nll_quant / predicted)
    return Fidelity(tokens=count, top1_agreement=agree / count, mean_kl=kl / count, ppl_float=ppl_float, ppl_w8a8=ppl_w8a8)


STUDY_ALPHAS: tuple[str | float, ...] = ("off", 0.5, "auto")


def smoothing_study(
    models: dict[str, Path],
    workdir: Path,
    data_sets: dict[str, str | Path | None],
    alphas: tuple[str | float, ...] = STUDY_ALPHAS,
    num_samples: int = 16,
    seq_len: int = 256,
    progress: bool = True,
) -> dict:
    """Naive W8A8 ("off"), a fixed and the searched alpha on each model and text set: fidelity ``rows`` and ``layers``."""
    rows, layers = [], {}
    for model_name, model in models.items():
        for alpha in alphas:
            artifact = calibrate(model, workdir / f"{model_name}-alpha-{alpha}", alpha=alpha, progress=False)
            layers[f"{model_name} alpha={alpha}"] = {name: rec["error"] for name, rec in artifact.manifest["layers"].items()}
            for set_name, texts in data_sets.items():
                result = evaluate(artifact.path, model, texts, num_samples=num_samples, seq_len=seq_len, progress=progress)
                rows.append({"model": model_name, "alpha": alpha, "set": set_name, **result.to_dict()})
    return {"rows": rows, "layers": layers}


def reference_of(files: ModelFiles, option: str = "--reference MODEL_DIR") -> Path:
    """The float checkpoint an artifact's manifest records, if that path still holds it; else an error naming ``option``."""
    if not files.is_artifact:
        raise QuasarError(f"{files.path}: not a W8A8 artifact (no quasar.json); calibrate it first")
    source = Path(files.manifest.get("source", {}).get("path", ""))
    if not source.parts or not (source / "config.json").is_file():
        raise QuasarError(f"{files.path}: the source checkpoint it records ({source}) is gone; give {option}")
    return source
