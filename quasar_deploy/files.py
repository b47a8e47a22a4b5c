"""File plumbing every writer shares: never overwrite, write atomically and durably, copy tokenizer files, hash, one-line errors.

Torch-free on purpose: the exporters' registry and the CLI reach it without loading the model code.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import sys
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
# In every directory being written until the write is complete; no loader accepts a directory holding it.
UNFINISHED = ".quasar-unfinished"
TEMP_PREFIX = ".tmp-"


def require_new(output: str | Path) -> Path:
    """``output`` as a Path, refused if it exists: we never overwrite a user's files, and we say so before any slow work."""
    output = Path(output)
    if output.exists():
        raise QuasarError(f"{output}: already exists; choose a new --output or remove it first")
    if output.is_symlink():
        raise QuasarError(f"{output}: is a dangling symbolic link; choose a new --output or remove the link first")
    parent = output.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise QuasarError(f"{output}: cannot create it ({parent} is not a writable directory)")
    return output


def refuse_unfinished(path: Path) -> None:
    """Loaders call this first: a directory still carrying the marker is a write that was killed (or is still running)."""
    if (path / UNFINISHED).exists():
        raise QuasarError(
            f"{path}: an unfinished write (a quasar-deploy calibrate or export was killed, or is still running); remove it and run again"
        )


def _try_lock(handle) -> bool:
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def remove_stale_writes(parent: Path) -> list[Path]:
    """Remove the temp dirs of killed writers in ``parent``; returns them.

    A writer holds an exclusive lock on its marker until it is done, and the kernel drops the
    lock when the process dies however it dies: a marker we can lock belongs to a dead writer.
    Directories without a marker are left alone (not ours, or a writer between mkdtemp and
    its marker, which holds nothing yet).
    """
    removed = []
    for tmp in sorted(parent.glob(f"{TEMP_PREFIX}*")):
        try:
            handle = open(tmp / UNFINISHED, "rb")
        except OSError:
            continue
        with handle:
            if not _try_lock(handle):
                continue
            try:
                _remove_marked(tmp)
            except OSError:  # another cleaner got there first, or it is not ours to remove
                continue
            removed.append(tmp)
    return removed


def _remove_marked(tmp: Path) -> None:
    """Delete the marker last: a cleaner killed halfway must leave a directory that is still refused and still cleaned."""
    for entry in tmp.iterdir():
        if entry.name == UNFINISHED:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    (tmp / UNFINISHED).unlink()
    tmp.rmdir()


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _sync_tree(root: Path) -> None:
    """Give every file and directory the modes a plain write would (mkdtemp makes 0700, safetensors 0600), and fsync them."""
    mask = _umask()
    for directory, _, names in os.walk(root, topdown=False):
        for name in names:
            path = os.path.join(directory, name)
            os.chmod(path, 0o666 & ~mask)
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
        os.chmod(directory, 0o777 & ~mask)
        _fsync_directory(Path(directory))


def _fsync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_directory(output: Path) -> Iterator[Path]:
    """A temp dir beside ``output`` that becomes ``output`` in one rename on success and vanishes on any failure.

    Readers then see either nothing or a complete directory, even after Ctrl-C or a full disk.
    A SIGKILL or power loss cannot run cleanup, so the temp dir carries ``UNFINISHED`` (locked
    while we write, refused by every loader), the next write beside it removes it, and the
    files are fsynced before the rename so a complete directory is complete on disk too.
    """
    output = require_new(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    for stale in remove_stale_writes(output.parent):
        print(f"warning: removed {stale}, left by an interrupted write", file=sys.stderr)
    tmp = Path(tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{output.name}-", dir=output.parent))
    try:
        # locked before it carries the marker's name, so no cleaner ever sees it unlocked while we live
        with open(tmp / f"{UNFINISHED}.new", "w") as marker:
            fcntl.flock(marker, fcntl.LOCK_EX)
            marker.write(f"pid {os.getpid()}\n")
            marker.flush()
            os.replace(tmp / f"{UNFINISHED}.new", tmp / UNFINISHED)
            yield tmp
            _sync_tree(tmp)
            os.replace(tmp, output)
            (output / UNFINISHED).unlink()
            _fsync_directory(output)
            _fsync_directory(output.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _inside(source: Path, path: Path) -> bool:
    """Whether ``path`` resolves inside ``source``, or into the blob store of a Hugging Face hub cache snapshot.

    Hub caches link ``snapshots/<rev>/tokenizer.json`` to ``../../blobs/<hash>``; anything
    else pointing out of the directory (``chat_template.jinja -> /etc/hostname``) would copy
    an unrelated file into what we write.
    """
    root, target = source.resolve(), path.resolve()
    blobs = root.parent.parent / "blobs" if root.parent.name == "snapshots" else None
    return target.is_relative_to(root) or (blobs is not None and target.is_relative_to(blobs))


def copy_files(source: Path, target: Path, names: Iterable[str] = TOKENIZER_FILES) -> None:
    """Copy those of ``names`` that ``source`` has as regular files inside it; warn about and skip the rest."""
    for name in names:
        path = source / name
        if not path.exists() and not path.is_symlink():
            continue
        if not path.is_file() or not _inside(source, path):
            print(f"warning: not copying {path}: not a regular file inside {source}", file=sys.stderr)
            continue
        shutil.copyfile(path, target / name)


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
