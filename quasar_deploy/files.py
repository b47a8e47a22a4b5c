"""File plumbing every writer shares: never overwrite, write atomically, copy tokenizer files, hash, one-line errors.

Torch-free on purpose: the exporters' registry and the CLI reach it without loading the model code.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from .errors import QuasarError

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "generation_config.json",
)


def require_new(output: str | Path) -> Path:
    """``output`` as a Path, refused if it exists: we never overwrite a user's files, and we say so before any slow work."""
    output = Path(output)
    if output.exists():
        raise QuasarError(f"{output}: already exists; choose a new --output or remove it first")
    return output


@contextmanager
def atomic_directory(output: Path) -> Iterator[Path]:
    """A temp dir beside ``output`` that becomes ``output`` in one rename on success and vanishes on any failure.

    Readers then see either nothing or a complete directory, even after Ctrl-C or a full disk.
    """
    output = require_new(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{output.name}-", dir=output.parent))
    try:
        yield tmp
        tmp.chmod(0o755)
        os.replace(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def copy_files(source: Path, target: Path, names: Iterable[str] = TOKENIZER_FILES) -> None:
    """Copy those of ``names`` that ``source`` has; checkpoints differ in which tokenizer files they ship."""
    for name in names:
        if (source / name).is_file():
            shutil.copy2(source / name, target / name)


def sha256_files(*paths: Path) -> str:
    """sha256 of the files' bytes in order, read in blocks so multi-GB weights never sit in memory whole."""
    digest = hashlib.sha256()
    for path in paths:
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 22), b""):
                digest.update(block)
    return digest.hexdigest()


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (or its type when it has none): third-party errors can run to pages."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
