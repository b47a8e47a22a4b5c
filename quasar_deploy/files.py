"""File plumbing every writer shares: never overwrite, write atomically and durably, copy tokenizer files, hash, one-line errors.

Torch-free: the exporters' registry and the CLI reach it without loading the model code."""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import stat
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


def model_directory(path: str | Path) -> Path:
    """``path`` as a Path once it is a directory that no write is still filling: what every loader checks first."""
    path = Path(path)
    if not path.exists():
        raise QuasarError(f"{path}: no such directory")
    if not path.is_dir():
        raise QuasarError(f"{path}: not a directory (expected a Hugging Face checkpoint or a quasar-deploy artifact or export)")
    refuse_unfinished(path)
    return path


def remove_stale_writes(parent: Path) -> list[Path]:
    """Remove the temp dirs of killed writers in ``parent`` (whose marker we can lock: the kernel drops dead writers' locks)."""
    removed = []
    for tmp in sorted(parent.glob(f"{TEMP_PREFIX}*")):
        try:
            handle = open(tmp / UNFINISHED, "rb")
        except OSError:
            continue
        with handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # a live writer's
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


def _sync_tree(root: Path) -> None:
    """Give every file and directory the modes a plain write would (mkdtemp makes 0700, safetensors 0600), and fsync them."""
    mask = os.umask(0o022)
    os.umask(mask)
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
    """A temp dir beside ``output`` that becomes ``output`` in one rename on success and vanishes on any failure (after a
    SIGKILL, its locked ``UNFINISHED`` marker keeps loaders off, and the next write beside it removes it)."""
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


MAX_NAME_BYTES = 255  # NAME_MAX of Linux file systems


def check_name(name: object, where: Path | str) -> str:
    """``name`` if it is one plain file name of at most ``MAX_NAME_BYTES``; else a one-line error naming ``where``."""
    if not isinstance(name, str) or name in ("", ".", "..") or "/" in name or "\\" in name:
        raise QuasarError(f"{where}: {ascii(name)[:80]} is not a file name")
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        raise QuasarError(f"{where}: the file name {ascii(name)[:80]} has control characters")
    try:
        size = len(name.encode())
    except UnicodeEncodeError:
        raise QuasarError(f"{where}: the file name {ascii(name)[:80]} is not valid UTF-8") from None
    if size > MAX_NAME_BYTES:
        raise QuasarError(f"{where}: a file name of {size} bytes ({ascii(name)[:40]}...); names are at most {MAX_NAME_BYTES} bytes")
    return name


def _inside(source: Path, path: Path) -> bool:
    """Whether ``path`` resolves inside ``source``, or into the blob store of a Hugging Face hub cache snapshot."""
    root, target = source.resolve(), path.resolve()
    blobs = root.parent.parent / "blobs" if root.parent.name == "snapshots" else None
    return target.is_relative_to(root) or (blobs is not None and target.is_relative_to(blobs))


def inside_file(directory: Path, name: str) -> Path | None:
    """``directory / name`` once it is a regular file inside ``directory``, links followed; None when nothing is there."""
    path = directory / check_name(name, directory)
    if not path.is_symlink() and not path.exists():
        return None
    if path.is_symlink() and not _inside(directory, path):
        raise QuasarError(f"{path}: a symbolic link out of {directory}; a model directory's files must be inside it")
    if not path.is_file():
        raise QuasarError(f"{path}: not a regular file")
    return path


def refuse_outside_links(directory: Path) -> None:
    """Refuse ``directory`` if a symbolic link anywhere in it leads out of it (``_inside``), for readers of a whole directory."""
    for root, dirs, names in os.walk(directory):
        for name in [*dirs, *names]:
            path = Path(root) / name
            if path.is_symlink() and not _inside(directory, path):
                raise QuasarError(f"{path}: a symbolic link out of {directory}; a model directory's files must be inside it")


def read_inside(directory: Path, name: str) -> bytes:
    """The bytes of ``directory / name`` once ``inside_file`` accepts it, read through a descriptor checked to be a regular file."""
    path = inside_file(directory, name)
    if path is None:
        raise QuasarError(f"{directory / name}: missing")
    with _open_regular(path) as handle:
        return handle.read()


def _open_regular(path: Path):
    """``path`` (links resolved first: ``inside_file`` vouched for where they lead) opened for reading, if a regular file."""
    fd = os.open(path.resolve(), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise QuasarError(f"{path}: not a regular file")
    return os.fdopen(fd, "rb")


# sha256 of the files verified in this process, by identity and change time (any write changes st_ctime_ns)
_verified: dict[tuple[int, ...], str] = {}


def verified_sha256(path: Path) -> str:
    """sha256 of the regular file at ``path``, remembered while the file is unchanged."""
    with _open_regular(path) as handle:
        info = os.fstat(handle.fileno())
        key = (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)
        if key not in _verified:
            digest = hashlib.sha256()
            for block in iter(lambda: handle.read(1 << 22), b""):
                digest.update(block)
            _verified[key] = digest.hexdigest()
        return _verified[key]


def copy_files(source: Path, target: Path, names: Iterable[str] = TOKENIZER_FILES) -> None:
    """Copy those of ``names`` that ``source`` has as regular files inside it; warn about and skip the rest."""
    for name in names:
        try:
            path = inside_file(source, name)
        except QuasarError as exc:
            print(f"warning: not copying {name}: {exc}", file=sys.stderr)
            continue
        if path is not None:
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
    """The first line of an exception's message (or its type when it has none)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
