"""Fail an image build whose installed packages are not the versions its constraints file pins.

The vLLM and vLLM-Ascend images come with their engine installed: this check is what ties a base image's tag to
the versions docker/README.md and docs/ describe. Run in every image's build, after the installs:

    python3 check_pins.py constraints.txt

Prints one line per package that is missing or at another version and exits 1; exits 0 when all match. A local
version label (``2.10.0+cpu``, ``0.23.0+empty``) does not count: it names the build, not the release.
Standard library only, as the base images' Pythons differ.
"""

from __future__ import annotations

import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path


def read_pins(path: Path) -> dict[str, str]:
    """``name==version`` lines (comments and blank lines skipped); anything else is a malformed constraints file."""
    pins = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, pinned = line.partition("==")
        if not sep or not name.strip() or not pinned.strip():
            raise ValueError(f"{path}:{number}: expected name==version, not {line!r}")
        pins[name.strip()] = pinned.strip()
    return pins


def mismatches(pins: dict[str, str]) -> list[str]:
    """One line per pinned package that is not installed at its pinned release."""
    found = []
    for name, pinned in sorted(pins.items()):
        try:
            installed = version(name)
        except PackageNotFoundError:
            found.append(f"{name}: pinned {pinned}, not installed")
            continue
        if installed.split("+", 1)[0] != pinned:
            found.append(f"{name}: pinned {pinned}, installed {installed}")
    return found


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: check_pins.py CONSTRAINTS", file=sys.stderr)
        return 2
    try:
        problems = mismatches(read_pins(Path(argv[0])))
    except (OSError, ValueError) as exc:
        problems = [str(exc)]
    for line in problems:
        print(f"error: {line}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
