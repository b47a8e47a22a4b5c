"""Manifests that list every file of a directory we wrote with its sha256, so what loads is exactly what was written.

``quasar.json`` and ``quasar-export.json`` hold ``files: {name: sha256}``; readers refuse a listed file missing or
altered and any unlisted one, before any parser reads them. Torch-free, like ``files.py``."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ._version import __version__
from .errors import QuasarError
from .files import UNFINISHED, check_name, inside_file, read_inside, sha256_files, verified_sha256

# documentation and git metadata that hubs add and nothing here reads
UNCHECKED = frozenset({"README.md", "LICENSE", ".gitattributes"})
MANIFEST = "quasar.json"  # an artifact's record
EXPORT_MANIFEST = "quasar-export.json"
EXPORT_FORMAT_VERSION = 1


def checksums(directory: Path, manifest: str) -> dict[str, str]:
    """sha256 of every file in ``directory`` but the manifest itself (and the write-in-progress marker)."""
    return {p.name: sha256_files(p) for p in sorted(directory.iterdir()) if p.is_file() and p.name not in (manifest, UNFINISHED)}


def write_manifest(directory: Path, manifest: str, record: dict) -> None:
    """Write ``record`` with the checksums of the files ``directory`` holds now: writers call it last."""
    record = {**record, "files": checksums(directory, manifest)}
    (directory / manifest).write_text(json.dumps(record, indent=2))


def read_manifest(directory: Path, manifest: str, version: int) -> dict:
    """The manifest as a dict, after checking the directory holds exactly the files it lists, and their bytes."""
    file = directory / manifest
    record = _json_object(directory, manifest)
    if record.get("format_version") != version:
        raise QuasarError(
            f"{file}: format {record.get('format_version')!r}, but this quasar-deploy reads format {version} only "
            "(older formats lack per-file checksums); write it again with this version"
        )
    verify_files(directory, file, record.get("files"))
    return record


def _json_object(directory: Path, name: str) -> dict:
    """``directory / name`` parsed as a JSON object (a manifest), read only if it is a regular file inside ``directory``."""
    file = directory / name
    try:
        record = json.loads(read_inside(directory, name))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        raise QuasarError(f"{file}: not valid JSON (corrupted manifest)") from None
    if not isinstance(record, dict):
        raise QuasarError(f"{file}: expected a JSON object, not {type(record).__name__} (corrupted manifest)")
    return record


def verify_files(directory: Path, file: Path, listed: object, verify: bool = True) -> None:
    """Refuse unlisted files, then listed ones missing, not regular files inside ``directory`` or (``verify``) altered."""
    if not isinstance(listed, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in listed.items()):
        raise QuasarError(f"{file}: 'files' must map file names to sha256 checksums (corrupted manifest)")
    for name in listed:
        check_name(name, file)
    for path in sorted(directory.iterdir()):
        if path.name not in listed and path.name not in (file.name, *UNCHECKED) and not (path.is_dir() and not path.is_symlink()):
            shown = directory / (path.name if path.name.isprintable() else ascii(path.name))  # one line, whatever the name
            raise QuasarError(f"{shown}: not listed in {file.name}; a directory we wrote holds exactly the files it lists: remove it")
    for name, digest in sorted(listed.items()):
        path = inside_file(directory, name)
        if path is None:
            raise QuasarError(f"{directory / name}: missing, but listed in {file.name} (incomplete copy?)")
        if verify and verified_sha256(path) != digest:
            raise QuasarError(f"{path}: checksum mismatch (corrupted or modified)")


def read_listed(directory: Path, name: str, listed: dict[str, str] | None) -> bytes | None:
    """The bytes of ``directory / name`` (None: missing), checked against ``listed`` (None: a checkpoint) as read."""
    if inside_file(directory, name) is None:
        return None
    data = read_inside(directory, name)
    if listed is not None and hashlib.sha256(data).hexdigest() != listed.get(name):
        raise QuasarError(f"{directory / name}: checksum mismatch (corrupted or modified)")
    return data


def listed_files(directory: Path) -> dict[str, str] | None:
    """The ``files`` of ``directory``'s export manifest (None: it has none), its listing checked; readers check the bytes they read."""
    if inside_file(directory, EXPORT_MANIFEST) is None:
        return None
    listed = _json_object(directory, EXPORT_MANIFEST).get("files")
    verify_files(directory, directory / EXPORT_MANIFEST, listed, verify=False)
    return listed


def write_export_manifest(directory: Path, target: str, source: Path, details: dict | None = None) -> None:
    """The last file an exporter writes: target, provenance, ``details`` for the target's loader, and the checksums."""
    record = {"format_version": EXPORT_FORMAT_VERSION, "target": target, "quasar_deploy_version": __version__, "source": str(source)}
    write_manifest(directory, EXPORT_MANIFEST, {**record, **(details or {})})


def export_target(directory: Path) -> str | None:
    """The target a directory was exported for, as its ``quasar-export.json`` records it (None: no export manifest)."""
    if inside_file(directory, EXPORT_MANIFEST) is None:
        return None
    target = _json_object(directory, EXPORT_MANIFEST).get("target")
    if not isinstance(target, str):
        raise QuasarError(f"{directory / EXPORT_MANIFEST}: no 'target' string (corrupted manifest)")
    return target


def read_export_manifest(directory: Path, target: str) -> dict:
    """What a loader of ``target`` exports checks first: the manifest exists, names ``target``, and every file matches it."""
    if inside_file(directory, EXPORT_MANIFEST) is None:
        raise QuasarError(f"{directory}: no {EXPORT_MANIFEST} (not a complete {target} export of this quasar-deploy); export it again")
    record = read_manifest(directory, EXPORT_MANIFEST, EXPORT_FORMAT_VERSION)
    if record.get("target") != target:
        raise QuasarError(f"{directory / EXPORT_MANIFEST}: a {record.get('target')!r} export, not {target!r}")
    return record
