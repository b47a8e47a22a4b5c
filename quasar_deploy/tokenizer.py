"""Loading a checkpoint's tokenizer with a one-line error instead of transformers' traceback."""

from __future__ import annotations

from pathlib import Path

from .errors import QuasarError
from .files import first_line


def load_tokenizer(path: str | Path, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    except Exception as exc:  # transformers raises many types for a missing or custom tokenizer
        raise QuasarError(f"{path}: cannot load the tokenizer ({exc.__class__.__name__}: {first_line(exc)})") from None
