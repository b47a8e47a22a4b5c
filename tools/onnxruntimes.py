"""The ONNX Runtime releases the project pins, read from the files that pin them, and a CPU build of each to test on.

Every ONNX model we write must load on each of them (quasar_deploy/exporters/onnx_versions.py): the images' releases
(``onnxruntime`` or ``onnxruntime-gpu`` in docker/*/constraints.txt; a GPU build is tested through the CPU build of
the same release, which has its model loader and CPU kernels) and the lowest the ``onnx`` extra allows (its
``onnxruntime>=`` floor in pyproject.toml). tests/test_onnx_runtimes.py runs exports on each; a release other than the
test environment's own comes from ``DIR/<version>``, where ``install`` puts it (.ci/run does, before the suite):

    python tools/onnxruntimes.py list                 # "<version> <where it is pinned>", one a line
    python tools/onnxruntimes.py install DIR          # pip install --target DIR/<version> for each one missing

Only the wheel itself is installed (``--no-deps``): it runs in a child process of the test environment's Python,
whose numpy is all a session needs. Standard library and ``packaging`` (a test dependency); Python 3.11 (tomllib).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
# the distributions of one release: the CPU build under its own name, the GPU build under its own
BUILDS = ("onnxruntime", "onnxruntime-gpu")
EXTRA = "onnx"


def constraints_pins(path: Path) -> dict[str, str]:
    """``{release: path}`` for an ``onnxruntime*==`` line of a constraints file (the format docker/check_pins.py reads)."""
    found = {}
    for line in path.read_text().splitlines():
        name, sep, pinned = line.split("#", 1)[0].strip().partition("==")
        if sep and canonicalize_name(name) in BUILDS:
            found[pinned.strip()] = str(path)
    return found


def extra_floor(pyproject: Path, extra: str = EXTRA) -> str:
    """The lowest ``onnxruntime`` release the extra allows: its ``>=`` or ``==`` bound (an extra without one lets pip
    take any release, which no test could cover)."""
    requirements = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"][extra]
    for text in requirements:
        requirement = Requirement(text)
        if canonicalize_name(requirement.name) == "onnxruntime":
            floors = [s.version for s in requirement.specifier if s.operator in (">=", "==")]
            if floors:
                return str(max(floors, key=Version))
            raise ValueError(f"{pyproject}: the {extra} extra's {text!r} has no lower bound")
    raise ValueError(f"{pyproject}: the {extra} extra does not require onnxruntime")


def pinned(root: Path = ROOT) -> dict[str, list[str]]:
    """``{release: [where it is pinned, ...]}``, releases in version order (one entry per release, however many pin it)."""
    sources = {path.relative_to(root).as_posix(): path for path in sorted(root.glob("docker/*/constraints.txt"))}
    found: dict[str, list[str]] = {}
    for name, path in sources.items():
        for release in constraints_pins(path):
            found.setdefault(release, []).append(name)
    found.setdefault(extra_floor(root / "pyproject.toml"), []).append(f"pyproject.toml [{EXTRA}] floor")
    return {release: found[release] for release in sorted(found, key=Version)}


def installed() -> str | None:
    """The release of the CPU build installed beside this Python, if any."""
    try:
        return version("onnxruntime")
    except PackageNotFoundError:
        return None


def runtime_dir(directory: Path, release: str) -> Path:
    return Path(directory) / release


def is_installed_in(directory: Path, release: str) -> bool:
    """Whether ``install`` put this release in ``directory``: its package, and metadata of that release (``1.20`` is
    ``1.20.0``), which pip writes last."""
    target = runtime_dir(directory, release)
    metadata = [Version(p.name.removesuffix(".dist-info").split("-", 1)[1]) for p in target.glob("onnxruntime-*.dist-info")]
    return (target / "onnxruntime" / "__init__.py").is_file() and Version(release) in metadata


def install(directory: Path, releases: list[str]) -> list[str]:
    """``pip install --target DIR/<release> onnxruntime==<release>`` for each release not installed in this Python nor
    there yet; the releases installed. A failed install leaves no folder behind."""
    done = []
    for release in releases:
        here = installed()
        if (here is not None and Version(here) == Version(release)) or is_installed_in(directory, release):
            continue
        target = runtime_dir(directory, release)
        shutil.rmtree(target, ignore_errors=True)
        command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target), f"onnxruntime=={release}"]
        if subprocess.run(command).returncode != 0:
            shutil.rmtree(target, ignore_errors=True)
            raise SystemExit(f"error: could not install onnxruntime=={release} into {target}")
        done.append(release)
    return done


def main(argv: list[str]) -> int:
    if argv == ["list"]:
        for release, where in pinned().items():
            print(release, ", ".join(where))
        return 0
    if len(argv) == 2 and argv[0] == "install":
        for release in install(Path(argv[1]), list(pinned())):
            print(f"installed onnxruntime {release} in {runtime_dir(Path(argv[1]), release)}")
        return 0
    print("usage: onnxruntimes.py list | install DIR", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
