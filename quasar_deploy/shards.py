"""Safetensors weights written tensor by tensor and split into shards the way Hugging Face splits them.

A calibrated 8B model must never sit in memory whole, but safetensors puts its header (names,
dtypes, shapes, byte offsets) before the data, and the header is known only once a shard's
last tensor is. So each shard's bytes go to an unnamed scratch file as tensors arrive, and
header and bytes are joined when the shard closes. Names and index follow ``save_pretrained``:
``model.safetensors`` when one shard suffices, else ``model-00001-of-0000N.safetensors`` and
``model.safetensors.index.json`` (``metadata.total_size``, ``weight_map``).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
MAX_SHARD_SIZE = 5 * 10**9  # save_pretrained's default, "5GB"
DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int8: "I8",
    torch.uint8: "U8",
}
TORCH_DTYPES = {name: dtype for dtype, name in DTYPES.items()}


def shard_names(count: int) -> list[str]:
    return [WEIGHTS] if count == 1 else [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


class ShardWriter:
    """Appends tensors to ``directory``'s weight shards; ``close`` names the shards and writes the index. Holds one tensor at a time."""

    def __init__(self, directory: Path, max_shard_size: int = MAX_SHARD_SIZE):
        if max_shard_size < 1:
            raise ValueError(f"max_shard_size must be >= 1 byte, not {max_shard_size}")
        self.directory = Path(directory)
        self.max_shard_size = max_shard_size
        self.shard_of: dict[str, int] = {}  # tensor name -> shard number, from 0
        self._closed: list[Path] = []
        self._header: dict[str, dict] = {}
        self._size = 0
        self._total = 0
        self._data = None

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self.add_blocks(name, tensor.dtype, tensor.shape, [tensor])

    def add_blocks(self, name: str, dtype: torch.dtype, shape: Sequence[int], blocks: Iterable[torch.Tensor]) -> None:
        """One tensor given as consecutive row blocks (host tensors): a copied embedding table never sits in memory whole."""
        if name in self.shard_of:
            raise ValueError(f"tensor {name!r} written twice")
        nbytes = math.prod(shape) * dtype.itemsize
        if self._header and self._size + nbytes > self.max_shard_size:
            self._close_shard()
        if self._data is None:
            self._data = tempfile.TemporaryFile(dir=self.directory)
        written = 0
        for block in blocks:
            if block.dtype != dtype:
                raise ValueError(f"tensor {name!r}: a {block.dtype} block in a {dtype} tensor")
            raw = block.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
            self._data.write(raw.data)
            written += raw.nbytes
        if written != nbytes:
            raise ValueError(f"tensor {name!r}: {written} bytes written, its shape {list(shape)} needs {nbytes}")
        self._header[name] = {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [self._size, self._size + nbytes]}
        self._size += nbytes
        self._total += nbytes
        self.shard_of[name] = len(self._closed)

    def _close_shard(self) -> None:
        header = json.dumps({"__metadata__": {"format": "pt"}, **self._header}, separators=(",", ":")).encode()
        header += b" " * (-len(header) % 8)  # the data starts 8-byte aligned, as safetensors itself writes it
        path = self.directory / f".shard-{len(self._closed)}"
        with open(path, "wb") as out:
            out.write(struct.pack("<Q", len(header)))
            out.write(header)
            if self._data is not None:
                self._data.seek(0)
                shutil.copyfileobj(self._data, out, 1 << 24)
                self._data.close()
        self._closed.append(path)
        self._header, self._size, self._data = {}, 0, None

    def close(self) -> None:
        """Finish the last shard, give every shard its final name, and write the index if there are several."""
        if self._header or not self._closed:
            self._close_shard()
        names = shard_names(len(self._closed))
        for path, name in zip(self._closed, names):
            os.replace(path, self.directory / name)
        if len(names) > 1:
            weight_map = {name: names[shard] for name, shard in sorted(self.shard_of.items())}
            index = {"metadata": {"total_size": self._total}, "weight_map": weight_map}
            (self.directory / INDEX).write_text(json.dumps(index, indent=2))
