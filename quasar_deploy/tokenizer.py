"""Loading a checkpoint's tokenizer with a one-line error instead of transformers' traceback or a silent fallback.

An artifact's or export's tokenizer is loaded from the bytes its manifest vouches for; a checkpoint's once no link in
its directory leads out."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from .artifact import ModelFiles
from .errors import QuasarError
from .files import TOKENIZER_FILES, first_line, refuse_outside_links
from .integrity import read_listed

# Any one of these is a tokenizer; without them transformers quietly builds a useless one-token tokenizer.
VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


def _model_vocab_size(path: Path) -> int | None:
    try:
        value = json.loads((path / "config.json").read_text()).get("vocab_size")
    except (OSError, ValueError, AttributeError, RecursionError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def load_tokenizer(files: ModelFiles, trust_remote_code: bool = False):
    """The tokenizer beside an opened model, read as its manifest vouches (``read_tokenizer``), without opening it again."""
    return read_tokenizer(files.path, files.listed, trust_remote_code)


def read_tokenizer(path: Path, listed: dict[str, str] | None, trust_remote_code: bool = False):
    """The tokenizer in ``path`` as ``listed`` vouches; refused when missing, or when it has ids the model has no embedding for."""
    if listed is None:
        refuse_outside_links(path)
        return _load(path, path, trust_remote_code)
    with tempfile.TemporaryDirectory(prefix="quasar-tokenizer-") as staged:
        for name in ("config.json", *TOKENIZER_FILES):
            data = read_listed(path, name, listed)
            if data is not None:
                (Path(staged) / name).write_bytes(data)
        return _load(Path(staged), path, trust_remote_code)


def _load(directory: Path, path: Path, trust_remote_code: bool):
    """The tokenizer in ``directory``, errors naming ``path`` (the model directory it stands for)."""
    from transformers import AutoTokenizer  # heavy: about a second to import, paid only when a tokenizer loads

    if not any((directory / name).is_file() for name in VOCABULARY_FILES):
        raise QuasarError(f"{path}: no tokenizer ({' / '.join(VOCABULARY_FILES)}); copy the tokenizer files of the original checkpoint")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(directory), trust_remote_code=trust_remote_code)
    except Exception as exc:  # transformers raises many types for a missing or custom tokenizer
        raise QuasarError(f"{path}: cannot load the tokenizer ({exc.__class__.__name__}: {first_line(exc)})") from None
    vocab_size = _model_vocab_size(directory)
    if vocab_size is not None and len(tokenizer) > vocab_size:
        raise QuasarError(
            f"{path}: the tokenizer has {len(tokenizer)} tokens (added tokens included) but the model's vocabulary is {vocab_size}; "
            "it belongs to another model"
        )
    return tokenizer
