"""Safetensors weights written tensor by tensor and split into shards the way Hugging Face splits them.

Each shard's bytes go to scratch files as tensors arrive (one per element size, so that every tensor is aligned as
``save_file`` aligns it) and are joined to the header, known last, when the shard closes."""

from __future__ import annotations

import json
import math
import os
import struct
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

STEM = "model"
WEIGHTS = f"{STEM}.safetensors"
INDEX = f"{STEM}.safetensors.index.json"
MAX_SHARD_SIZE = 5 * 10**9  # save_pretrained's default, "5GB"
DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int8: "I8", torch.uint8: "U8",
}  # fmt: skip
TORCH_DTYPES = {name: dtype for dtype, name in DTYPES.items()}


def shard_names(count: int, stem: str = STEM) -> list[str]:
    return [f"{stem}.safetensors"] if count == 1 else [f"{stem}-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


class ShardWriter:
    """Appends tensors to ``directory``'s weight shards; ``close`` names the shards and writes the index. Holds one tensor at a time."""

    def __init__(self, directory: Path, max_shard_size: int = MAX_SHARD_SIZE, stem: str = STEM):
        if max_shard_size < 1:
            raise ValueError(f"max_shard_size must be >= 1 byte, not {max_shard_size}")
        self.directory, self.max_shard_size, self.stem = Path(directory), max_shard_size, stem
        self.shard_of: dict[str, int] = {}  # tensor name -> shard number, from 0
        self._closed: list[Path] = []
        self._buckets: dict[int, _Bucket] = {}  # by element size: the current shard's data
        self._size = self._total = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self.add_blocks(name, tensor.dtype, tensor.shape, [tensor])

    def add_blocks(self, name: str, dtype: torch.dtype, shape: Sequence[int], blocks: Iterable[torch.Tensor]) -> None:
        """One tensor given as consecutive row blocks (host tensors): a copied embedding table never sits in memory whole."""
        if name in self.shard_of:
            raise ValueError(f"tensor {name!r} written twice")
        nbytes = math.prod(shape) * dtype.itemsize
        if self._buckets and self._size + nbytes > self.max_shard_size:
            self._close_shard()
        bucket = self._buckets.setdefault(dtype.itemsize, _Bucket(self.directory))
        written = 0
        for block in blocks:
            if block.dtype != dtype:
                raise ValueError(f"tensor {name!r}: a {block.dtype} block in a {dtype} tensor")
            raw = block.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
            bucket.data.write(raw.data)
            written += raw.nbytes
        if written != nbytes:
            raise ValueError(f"tensor {name!r}: {written} bytes written, its shape {list(shape)} needs {nbytes}")
        bucket.entries[name] = {"dtype": DTYPES[dtype], "shape": list(shape), "data_offsets": [bucket.size, bucket.size + nbytes]}
        bucket.size += nbytes
        self._size += nbytes
        self._total += nbytes
        self.shard_of[name] = len(self._closed)

    def _close_shard(self) -> None:
        """Header, then the tensors in ``save_file``'s order (widest element first, then by name), as zero-copy loads expect."""
        order = [self._buckets[size] for size in sorted(self._buckets, reverse=True)]
        header: dict[str, dict] = {"__metadata__": {"format": "pt"}}
        start = 0
        for bucket in order:
            for name, entry in sorted(bucket.entries.items()):
                size = entry["data_offsets"][1] - entry["data_offsets"][0]
                header[name] = {**entry, "data_offsets": [start, start + size]}
                start += size
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
        path = self.directory / f".shard-{len(self._closed)}"
        with open(path, "wb") as out:
            out.write(struct.pack("<Q", len(raw)))
            out.write(raw)
            for bucket in order:
                for _, entry in sorted(bucket.entries.items()):
                    begin, end = entry["data_offsets"]
                    bucket.data.seek(begin)
                    _copy_range(bucket.data, out, end - begin)
                bucket.data.close()
        self._closed.append(path)
        self._buckets, self._size = {}, 0

    def close(self) -> None:
        """Finish the last shard, give every shard its final name, and write the index if there are several."""
        if self._buckets or not self._closed:
            self._close_shard()
        names = shard_names(len(self._closed), self.stem)
        for path, name in zip(self._closed, names):
            os.replace(path, self.directory / name)
        if len(names) > 1:
            weight_map = {name: names[shard] for name, shard in sorted(self.shard_of.items())}
            index = {"metadata": {"total_size": self._total}, "weight_map": weight_map}
            (self.directory / f"{self.stem}.safetensors.index.json").write_text(json.dumps(index, indent=2))


def _copy_range(source, target, size: int, block: int = 1 << 24) -> None:
    while size > 0:
        chunk = source.read(min(block, size))
        target.write(chunk)
        size -= len(chunk)


class _Bucket:
    """One shard's tensors of one element size: their bytes in an unnamed scratch file, their offsets within it."""

    def __init__(self, directory: Path):
        self.data = tempfile.TemporaryFile(dir=directory)
        self.entries: dict[str, dict] = {}
        self.size = 0
