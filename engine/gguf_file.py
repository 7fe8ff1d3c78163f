"""The tensor directory of a GGUF file, memory-mapped, without parsing its metadata values.

`gguf.GGUFReader` builds a numpy view for every metadata element: for a file carrying a
150k-token vocabulary and its merges that takes ~10 s. The loader needs only the tensors
and the architecture's hyper-parameters, so this reads the header (GGUF v2/v3,
little-endian), keeps scalar values and short numeric arrays, skips the rest (the
vocabulary, the merges) by type, and maps the tensor data:

    magic "GGUF" | version u32 | num_tensors u64 | num_kv u64
    num_kv x (key: string, type: u32, value)         string = u64 length + bytes
    num_tensors x (name: string, n_dims: u32, dims: n_dims x u64, type: u32, offset: u64)
    padding to `general.alignment` (default 32) | tensor data (offsets from here)
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

# GGUF value types: 0..7 u8 i8 u16 i16 u32 i32 f32 bool, 8 string, 9 array, 10..12 u64 i64 f64
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_FORMATS = dict(zip((0, 1, 2, 3, 4, 5, 6, 7, 10, 11, 12), "BbHhIif?Qqd", strict=True))
_STRING, _ARRAY = 8, 9
_KEPT_ARRAY = 4096  # numeric arrays up to this many items are kept (per-layer values)


@dataclass(frozen=True, slots=True)
class GgufTensor:
    """One tensor: `shape` in GGUF order (ne0 = K first), `data` its bytes as uint8
    [rows, row_bytes] (1-D tensors: [bytes]), a view of the mapped file."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray
    offset: int | None = None  # the first byte's position in the file (None: not read
    # from one, a stand-in: map_tensor refuses it)


def map_tensor(path: Path, tensor: GgufTensor) -> np.ndarray:
    """`tensor`'s bytes (`data`'s shape) in a mapping of their own of the file at `path`,
    copy-on-write and never written: its pages are the page cache's, resident in this
    process only once read through this mapping, whatever `read_gguf`'s mapping touched
    while loading (a table read a few rows at a time, as llama.cpp's mmap serves its
    token embeddings). ValueError for a tensor not read from a file (no offset)."""
    if tensor.offset is None:
        raise ValueError(f"{tensor.name}: not read from a file, no offset to map")
    return np.memmap(path, dtype=np.uint8, mode="c", offset=tensor.offset,
                     shape=tensor.data.shape)


@dataclass(frozen=True, slots=True)
class GgufFile:
    """`metadata`: every scalar key's value, and numeric arrays of at most 4096 items as
    tuples; string arrays (the vocabulary) and longer arrays are left out."""

    architecture: str
    tensors: dict[str, GgufTensor]
    metadata: dict[str, object]


class _Cursor:
    def __init__(self, buf: np.ndarray) -> None:
        self.buf, self.pos = buf.data, 0  # a memoryview of the mapped bytes

    def unpack(self, fmt: str):
        values = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return values[0] if len(values) == 1 else values

    def string(self) -> str:
        length = self.unpack("Q")
        self.pos += length
        return bytes(self.buf[self.pos - length : self.pos]).decode("utf-8", "replace")

    def value(self, kind: int, keep: bool) -> object:
        """Read (or, unless `keep`, skip) a value of GGUF type `kind`: a numeric array of at
        most `_KEPT_ARRAY` items as a tuple; other arrays are skipped (None)."""
        if kind in _FIXED:
            if keep:
                return self.unpack(_FORMATS[kind])
            self.pos += _FIXED[kind]
        elif kind == _STRING:
            if keep:
                return self.string()
            length = self.unpack("Q")  # (not `pos += unpack()`: that reads pos first)
            self.pos += length
        elif kind == _ARRAY:
            item, count = self.unpack("IQ")
            if item in _FIXED and keep and count <= _KEPT_ARRAY:
                fmt = f"<{count}{_FORMATS[item]}"
                values = struct.unpack_from(fmt, self.buf, self.pos)
                self.pos += struct.calcsize(fmt)
                return values
            if item in _FIXED:
                self.pos += _FIXED[item] * count
            else:
                for _ in range(count):
                    self.value(item, keep=False)
        else:
            raise ValueError(f"unknown GGUF value type {kind} at byte {self.pos}")
        return None


def read_gguf(path: Path) -> GgufFile:
    """The architecture and the tensors of the GGUF file at `path` (ValueError if it is
    not one)."""
    buf = np.memmap(path, dtype=np.uint8, mode="r")
    cursor = _Cursor(buf)
    magic, version, num_tensors, num_kv = cursor.unpack("4sIQQ")
    if magic != b"GGUF" or version not in (2, 3):
        raise ValueError(f"not a GGUF v2/v3 file (magic {magic!r}, version {version})")
    wanted: dict[str, object] = {"general.architecture": None, "general.alignment": 32}
    metadata: dict[str, object] = {}
    for _ in range(num_kv):
        key, kind = cursor.string(), cursor.unpack("I")
        value = cursor.value(kind, keep=True)
        if value is not None:
            metadata[key] = value
        if key in wanted:
            wanted[key] = value
    infos = []
    for _ in range(num_tensors):
        name, n_dims = cursor.string(), cursor.unpack("I")
        shape = tuple(cursor.unpack("Q") for _ in range(n_dims))
        infos.append((name, shape, *cursor.unpack("IQ")))
    align = wanted["general.alignment"]
    if not isinstance(align, int) or align <= 0:
        raise ValueError(f"GGUF general.alignment is {align!r}, not a positive integer")
    start = -(-cursor.pos // align) * align
    tensors: dict[str, GgufTensor] = {}
    for name, shape, ggml_type, offset in infos:
        kind = GGMLQuantizationType(ggml_type)
        per_block, block_bytes = GGML_QUANT_SIZES[kind]
        rows = int(np.prod(shape[1:]))
        row_bytes = shape[0] // per_block * block_bytes
        begin = start + offset
        data = buf[begin : begin + rows * row_bytes]
        tensors[name] = GgufTensor(name, kind, shape,
                                   data.reshape(rows, row_bytes) if len(shape) > 1 else data,
                                   begin)
    return GgufFile(str(wanted["general.architecture"]), tensors, metadata)


__all__ = ["GgufFile", "GgufTensor", "map_tensor", "read_gguf"]
