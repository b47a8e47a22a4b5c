"""Reading a local Hugging Face checkpoint directory, tensor by tensor, with one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from .errors import QuasarError
from .files import refuse_unfinished, sha256_files


class Checkpoint:
    """A directory with ``config.json`` and one or more ``*.safetensors`` files."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.exists():
            raise QuasarError(f"{self.path}: no such directory")
        if not self.path.is_dir():
            raise QuasarError(f"{self.path}: not a directory (expected a Hugging Face checkpoint directory)")
        refuse_unfinished(self.path)
        config_file = self.path / "config.json"
        if not config_file.is_file():
            raise QuasarError(f"{self.path}: no config.json (not a Hugging Face checkpoint directory)")
        try:
            self.config = json.loads(config_file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise QuasarError(f"{config_file}: not valid JSON ({exc})") from None
        self.files = sorted(self.path.glob("*.safetensors"))
        if not self.files:
            hint = " (PyTorch .bin weights are not supported: save with safe_serialization=True)" if list(self.path.glob("*.bin")) else ""
            raise QuasarError(f"{self.path}: no *.safetensors weights{hint}")
        self._where: dict[str, Path] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, str] = {}  # safetensors' names: "F32", "BF16", "I8", ...
        for file in self.files:
            try:
                with safe_open(file, "pt") as handle:
                    for name in handle.keys():
                        self._where[name] = file
                        tensor = handle.get_slice(name)
                        self.shapes[name] = tuple(tensor.get_shape())
                        self.dtypes[name] = tensor.get_dtype()
            except (SafetensorError, OSError) as exc:
                raise QuasarError(f"{file}: unreadable safetensors file ({exc})") from None

    @property
    def names(self) -> set[str]:
        return set(self._where)

    def tensor(self, name: str) -> torch.Tensor:
        file = self._where.get(name)
        if file is None:
            raise QuasarError(f"{self.path}: tensor {name!r} is missing")
        try:
            with safe_open(file, "pt") as handle:
                return handle.get_tensor(name)
        except (SafetensorError, OSError) as exc:
            raise QuasarError(f"{file}: tensor {name!r} is unreadable ({exc})") from None

    def fingerprint(self) -> str:
        """sha256 over config and weight files, so an artifact names exactly what it came from."""
        return sha256_files(self.path / "config.json", *self.files)
