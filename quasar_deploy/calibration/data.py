"""Calibration and evaluation text: built-in sets, JSONL files or plain text, tokenized into samples."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ..errors import QuasarError

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
BUILTIN = {"calibration": DATA_DIR / "calibration.jsonl", "eval": DATA_DIR / "eval.jsonl", "prompts": DATA_DIR / "prompts.jsonl"}
TEXT_FIELDS = ("text", "turns", "inputs_pretokenized", "prompt")


def _record_text(record: object, where: str) -> str:
    if isinstance(record, str):
        return record
    if isinstance(record, dict):
        for field in TEXT_FIELDS:
            value = record.get(field)
            if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
                return "\n".join(value)
            if isinstance(value, str):
                return value
    raise QuasarError(f"{where}: no text field (expected one of {', '.join(TEXT_FIELDS)})")


def read_texts(path: str | Path | None, default: str = "calibration") -> list[str]:
    """JSONL (``text``, ``turns``, ``inputs_pretokenized`` or ``prompt``) or plain text (blank-line separated)."""
    path = BUILTIN[default] if path is None else Path(path)
    try:
        raw = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise QuasarError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise QuasarError(f"{path}: unreadable ({exc.__class__.__name__}: {exc})") from None
    if path.suffix in (".jsonl", ".json"):
        texts = []
        for number, line in enumerate(raw.splitlines(), start=1):
            if line.strip():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise QuasarError(f"{path}:{number}: invalid JSON ({exc.msg})") from None
                texts.append(_record_text(record, f"{path}:{number}"))
    else:
        texts = [block.strip() for block in raw.split("\n\n") if block.strip()]
    texts = [t for t in texts if t.strip()]
    if not texts:
        raise QuasarError(f"{path}: contains no text")
    return texts


def token_samples(tokenizer, texts: list[str], num_samples: int, seq_len: int) -> list[list[int]]:
    """Up to ``num_samples`` token sequences of at most ``seq_len``; long texts are cut into several windows."""
    if num_samples < 1 or seq_len < 2:
        raise QuasarError("need --num-samples >= 1 and --seq-len >= 2")
    samples: list[list[int]] = []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=True)["input_ids"]
        for start in range(0, len(ids), seq_len):
            window = ids[start : start + seq_len]
            if len(window) >= 2:
                samples.append(window)
            if len(samples) == num_samples:
                return samples
    return samples


def fingerprint(samples: list[list[int]]) -> str:
    return hashlib.sha256(json.dumps(samples).encode()).hexdigest()


def calibration_samples(tokenizer, path: str | Path | None, num_samples: int, seq_len: int) -> list[list[int]]:
    """``token_samples`` of the calibration set; a set with no usable sample fails here, before the model loads."""
    samples = token_samples(tokenizer, read_texts(path), num_samples, seq_len)
    if not samples:
        raise QuasarError(f"{path or 'built-in calibration set'}: no sample of at least 2 tokens")
    return samples
