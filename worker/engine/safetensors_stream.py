"""Reads a safetensors file one tensor at a time with plain reads.

safetensors' own reader maps the whole file: every page a tensor was read from stays resident in the process (and
counts in its RSS) until the file is closed, so loading a shard held all of it at once. Read here, a tensor's bytes
go straight into its own buffer, freed when the caller drops it: host memory holds one tensor in flight.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
MAX_HEADER = 100 << 20  # the format's own limit


class SafetensorsError(ValueError):
    """A file whose header or data does not hold together."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute offsets in the file
    end: int


def read_header(file: Path) -> list[TensorInfo]:
    """The file's tensors in the order their bytes lie, checked against its size."""
    size = os.path.getsize(file)
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise SafetensorsError("shorter than a header")
        (length,) = struct.unpack("<Q", head)
        if length > min(MAX_HEADER, size - 8):
            raise SafetensorsError(f"header length {length} exceeds the file")
        try:
            header = json.loads(f.read(length))
        except ValueError as e:
            raise SafetensorsError(f"header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise SafetensorsError("header is not a JSON object")
    base = 8 + length
    tensors = [_info(name, entry, base, size) for name, entry in header.items() if name != "__metadata__"]
    return sorted(tensors, key=lambda t: t.start)


def _info(name: str, entry: dict, base: int, size: int) -> TensorInfo:
    try:
        dtype = DTYPES[entry["dtype"]]
        shape = tuple(int(d) for d in entry["shape"])
        start, end = (base + int(o) for o in entry["data_offsets"])
    except (KeyError, TypeError, ValueError) as e:
        raise SafetensorsError(f"tensor {name}: bad header entry ({e!r})") from None
    numel = 1
    for d in shape:
        numel *= d
    if not base <= start <= end <= size or end - start != numel * dtype.itemsize:
        raise SafetensorsError(f"tensor {name}: offsets {start - base}..{end - base} do not hold {shape} {dtype}")
    return TensorInfo(name, dtype, shape, start, end)


def read_tensor(f, info: TensorInfo) -> torch.Tensor:
    """One tensor's bytes read into a new CPU tensor."""
    data = torch.empty(info.end - info.start, dtype=torch.uint8)
    f.seek(info.start)
    if f.readinto(data.numpy()) != len(data):
        raise SafetensorsError(f"tensor {info.name}: file ends inside its data")
    return data.view(info.dtype).reshape(info.shape)


def tensors(file: Path) -> Iterator[tuple[TensorInfo, Callable[[], torch.Tensor]]]:
    """(info, read) for each tensor of the file: read() returns it; a tensor never read costs no I/O."""
    infos = read_header(file)
    with open(file, "rb", buffering=0) as f:
        for info in infos:
            yield info, lambda info=info: read_tensor(f, info)
