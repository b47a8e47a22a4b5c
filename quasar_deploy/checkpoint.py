"""Reading a local Hugging Face checkpoint directory, tensor by tensor (or row by row), with one-line errors."""

from __future__ import annotations

import json
import math
import mmap
import struct
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from .errors import QuasarError
from .files import first_line, inside_file, model_directory, read_inside, sha256_files
from .shards import INDEX, TORCH_DTYPES


class Checkpoint:
    """A directory with ``config.json`` and one or more ``*.safetensors`` files (sharded: as ``model.safetensors.index.json`` lists)."""

    def __init__(self, path: str | Path):
        self.path = model_directory(path)
        if inside_file(self.path, "config.json") is None:
            raise QuasarError(f"{self.path}: no config.json (not a Hugging Face checkpoint directory)")
        try:
            self.config = json.loads(read_inside(self.path, "config.json"))
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
            raise QuasarError(f"{self.path / 'config.json'}: not valid JSON ({first_line(exc)})") from None
        self.files = sorted(inside_file(self.path, file.name) for file in self.path.glob("*.safetensors"))
        if not self.files:
            hint = " (PyTorch .bin weights are not supported: save with safe_serialization=True)" if list(self.path.glob("*.bin")) else ""
            raise QuasarError(f"{self.path}: no *.safetensors weights{hint}")
        weight_map = self._weight_map()
        self._where: dict[str, Path] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, str] = {}  # safetensors' names: "F32", "BF16", "I8", ...
        for file in self.files:
            try:
                with safe_open(file, "pt") as handle:
                    for name in handle.keys():
                        if weight_map is not None and weight_map.get(name) != file.name:
                            raise QuasarError(f"{file}: holds {name!r}, which {INDEX} maps to {weight_map.get(name)!r} (mixed-up shards)")
                        self._where[name] = file
                        tensor = handle.get_slice(name)
                        self.shapes[name] = tuple(tensor.get_shape())
                        self.dtypes[name] = tensor.get_dtype()
            except (SafetensorError, OSError) as exc:
                raise QuasarError(f"{file}: unreadable safetensors file ({exc})") from None
        if weight_map is not None and weight_map.keys() - self._where.keys():
            missing = sorted(weight_map.keys() - self._where.keys())[0]
            raise QuasarError(f"{self.path / INDEX}: lists {missing!r} in {weight_map[missing]}, which does not hold it (incomplete copy?)")

    def _weight_map(self) -> dict[str, str] | None:
        """The index's name -> file map, if there is an index; a shard it does not list is refused (a stray file, not a weight)."""
        index = self.path / INDEX
        if inside_file(self.path, INDEX) is None:
            return None
        try:
            weight_map = json.loads(read_inside(self.path, INDEX)).get("weight_map")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError, RecursionError):
            raise QuasarError(f"{index}: not a JSON object (corrupted index)") from None
        if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
            raise QuasarError(f"{index}: 'weight_map' must map tensor names to file names (corrupted index)")
        listed = set(weight_map.values())
        for file in self.files:
            if file.name not in listed:
                raise QuasarError(f"{file}: not listed in {INDEX}; remove it (or restore the index that lists it)")
        absent = sorted(listed - {file.name for file in self.files})
        if absent:
            raise QuasarError(f"{self.path / absent[0]}: missing, but listed in {INDEX} (incomplete download?)")
        return weight_map

    @property
    def names(self) -> set[str]:
        return set(self._where)

    @contextmanager
    def _opened(self, name: str) -> Iterator:
        """The open file holding ``name``, with read errors turned into one line naming file and tensor."""
        file = self._where.get(name)
        if file is None:
            raise QuasarError(f"{self.path}: tensor {name!r} is missing")
        try:
            with safe_open(file, "pt") as handle:
                yield handle
        except (SafetensorError, OSError) as exc:
            raise QuasarError(f"{file}: tensor {name!r} is unreadable ({exc})") from None

    def tensor(self, name: str) -> torch.Tensor:
        with self._opened(name) as handle:
            return handle.get_tensor(name)

    def mapped(self, name: str) -> tuple[torch.Tensor, mmap.mmap] | None:
        """``name`` over a private memory map of its file, and the map; None where its bytes are not aligned for its dtype."""
        file = self._where.get(name)
        if file is None:
            raise QuasarError(f"{self.path}: tensor {name!r} is missing")
        try:
            with open(file, "rb") as handle:
                pages = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
            (header_bytes,) = struct.unpack("<Q", pages[:8])
            entry = json.loads(pages[8 : 8 + header_bytes])[name]
        except (OSError, ValueError, KeyError, struct.error) as exc:
            raise QuasarError(f"{file}: tensor {name!r} is unreadable ({first_line(exc)})") from None
        dtype = TORCH_DTYPES[entry["dtype"]]
        begin, end = entry["data_offsets"]
        offset = 8 + header_bytes + begin
        if offset % dtype.itemsize:
            return None
        tensor = torch.frombuffer(pages, dtype=dtype, count=(end - begin) // dtype.itemsize, offset=offset)
        return tensor.view(entry["shape"]), pages

    def rows(self, name: str, index: Sequence[int]) -> torch.Tensor:
        """Rows ``index`` of a 2-D tensor, read one by one: the embeddings of the calibration tokens, not the whole table."""
        with self._opened(name) as handle:
            part = handle.get_slice(name)
            return torch.cat([part[i : i + 1] for i in index])

    def row_blocks(self, name: str, block_bytes: int = 1 << 26) -> Iterator[torch.Tensor]:
        """The tensor as consecutive row blocks of about ``block_bytes``: a large tensor copied without being held whole."""
        shape = self.shapes[name]
        row_bytes = math.prod(shape[1:]) * TORCH_DTYPES[self.dtypes[name]].itemsize
        step = max(1, block_bytes // max(1, row_bytes))
        with self._opened(name) as handle:
            part = handle.get_slice(name)
            for start in range(0, shape[0], step):
                yield part[start : start + step]

    def fingerprint(self) -> str:
        """sha256 over config and weight files, so an artifact names exactly what it came from."""
        return sha256_files(self.path / "config.json", *self.files)
