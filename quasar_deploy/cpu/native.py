"""Our C kernels (``decoder_ops.c``, ``int8_linear.c``, ``half_linear.c``): built with the system's C compiler, and probed by running them.

A kernel is compiled once per source, compiler and flags into the cache directory, or found prebuilt in
``$QUASAR_KERNELS``. A build runs here if its self-check (``quasar_probe``) passes in a child process, where an
instruction the CPU lacks kills the child, not the caller.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from ..cache import cache_dir
from ..files import first_line
from .threads import parallel_entry_points

PREBUILT_ENV = "QUASAR_KERNELS"  # a directory of prebuilt <name>.so, used before compiling
COMMON_FLAGS = ["-O3", "-shared", "-fPIC"]
MIN_SHARE_BYTES = 1 << 19  # a thread's share of a linear's weights: handing it over costs about what reading this takes


class BlockShares:
    """How a linear kernel's calls share its packed blocks of output columns among threads: up to ``most`` shares of
    about equal whole blocks, each at least ``MIN_SHARE_BYTES``; ``edges(n)`` their bounds (int32, made once per n)."""

    def __init__(self, blocks: int, weight_bytes: int):
        self.blocks = blocks
        self.most = max(1, min(blocks, weight_bytes // MIN_SHARE_BYTES))
        self._edges: dict[int, torch.Tensor] = {}

    def edges(self, shares: int) -> torch.Tensor:
        """The bounds of ``shares`` shares, [shares + 1]."""
        if shares not in self._edges:
            self._edges[shares] = torch.tensor([self.blocks * t // shares for t in range(shares + 1)], dtype=torch.int32)
        return self._edges[shares]


def compile_command(compiler: str, source: Path | str, output: Path | str, flags: list[str]) -> list[str]:
    """The command that builds ``source`` into ``output``: the one the cache and the CPU image's build stage both run."""
    return [compiler, *COMMON_FLAGS, *flags, "-o", str(output), str(source), "-lm"]


def build(source: Path, name: str, flags: list[str]) -> Path:
    """The shared library ``name`` of ``source`` built with ``flags``: ``$QUASAR_KERNELS/<name>.so`` where it is there,
    else compiled once into the cache (atomically) with ``$CC`` or ``cc``. Raises OSError or ``CalledProcessError``."""
    prebuilt = os.environ.get(PREBUILT_ENV)
    if prebuilt and (Path(prebuilt) / f"{name}.so").is_file():
        return Path(prebuilt) / f"{name}.so"
    compiler = os.environ.get("CC") or "cc"
    digest = hashlib.sha256(source.read_bytes() + repr((compiler, flags)).encode()).hexdigest()[:16]
    directory = cache_dir() / "kernels"
    path = directory / f"{name}-{digest}.so"
    if path.exists():
        return path
    if shutil.which(compiler) is None:
        raise OSError(f"no C compiler ({compiler}) on PATH")
    directory.mkdir(parents=True, exist_ok=True)
    handle, partial = tempfile.mkstemp(dir=directory, suffix=".so.partial")
    os.close(handle)
    try:
        subprocess.run(compile_command(compiler, source, partial, flags), check=True, capture_output=True, timeout=300)
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    return path


def built_and_probed(source: Path, name: str, flags: list[str]) -> tuple[Path | None, str | None]:
    """``build`` then the build's self-check in a child process: the library's path, or None and why (one line)."""
    try:
        path = build(source, name, flags)
    except (OSError, subprocess.SubprocessError) as error:
        return None, _error_line(error)
    check = subprocess.run(
        [sys.executable, "-c", f"import ctypes, sys; sys.exit(ctypes.CDLL({str(path)!r}).quasar_probe())"], capture_output=True, timeout=60
    )
    if check.returncode != 0:
        return None, f"failed its self-check (exit {check.returncode})"
    return path, None


def opened(path: Path, interface_entry: str, interface: int) -> tuple[ctypes.CDLL | None, str | None]:
    """The library at ``path``; or None and why where ``interface_entry`` does not return ``interface`` (another version's)."""
    library = ctypes.CDLL(str(path))
    found = getattr(library, interface_entry)() if hasattr(library, interface_entry) else None
    if found != interface:
        return None, f"{path} was built from another version's source (interface {found}, this version calls {interface}); rebuild it"
    return library, None


def hand_openmp(library: ctypes.CDLL, entry: str) -> bool:
    """Hand ``library``'s ``entry`` torch's OpenMP runtime, to share its calls among torch's threads; whether there is one."""
    runtime = parallel_entry_points()
    if runtime is None:
        return False
    function = getattr(library, entry)
    function.argtypes, function.restype = [ctypes.c_void_p] * 3, None
    function(*runtime)
    return True


def _error_line(error: Exception) -> str:
    """A compiler's first line of complaint, else the error's own."""
    stderr = getattr(error, "stderr", None)
    stderr = stderr.decode(errors="replace") if isinstance(stderr, bytes) else stderr
    return stderr.strip().splitlines()[0] if stderr and stderr.strip() else first_line(error)
