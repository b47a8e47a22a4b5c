"""Loading a checkpoint's tokenizer with a one-line error instead of transformers' traceback or a silent fallback."""

from __future__ import annotations

import json
from pathlib import Path

from .errors import QuasarError
from .files import first_line

# Any one of these is a tokenizer; without them transformers quietly builds a useless one-token tokenizer.
VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


def _model_vocab_size(path: Path) -> int | None:
    try:
        value = json.loads((path / "config.json").read_text()).get("vocab_size")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def load_tokenizer(path: str | Path, trust_remote_code: bool = False):
    """The tokenizer beside a model; refused when missing, or when it has ids the model has no embedding for."""
    from transformers import AutoTokenizer

    path = Path(path)
    if not any((path / name).is_file() for name in VOCABULARY_FILES):
        raise QuasarError(f"{path}: no tokenizer ({' / '.join(VOCABULARY_FILES)}); copy the tokenizer files of the original checkpoint")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    except Exception as exc:  # transformers raises many types for a missing or custom tokenizer
        raise QuasarError(f"{path}: cannot load the tokenizer ({exc.__class__.__name__}: {first_line(exc)})") from None
    vocab_size = _model_vocab_size(path)
    if vocab_size is not None and len(tokenizer) > vocab_size:
        raise QuasarError(
            f"{path}: the tokenizer has {len(tokenizer)} tokens (added tokens included) but the model's vocabulary is {vocab_size}; "
            "it belongs to another model"
        )
    return tokenizer
