"""A GGUF file's header in one pass: its metadata as plain values, its tensor index, and each
tensor's bytes as a view of one read-only memory map (the layout gguf-py's GGUFReader gives them).

Why not GGUFReader itself (its constants and block sizes are still what FreeToken uses): it makes
a numpy view of every part of every metadata value, so a real vocabulary (Qwen3's 151,936 tokens
and 151,387 merges) took 6.3-6.7 s to open on the Xeon model-167 VM, before any weight was read;
here (0.10 s) a metadata string is one slice of the map and a number array one np.frombuffer.

The format (GGUF versions 2 and 3, little-endian): magic, version u32, tensor count u64, key count
u64; each key a string (u64 length, UTF-8 bytes), a value type u32 and the value (an array: its
element type u32, count u64, elements); each tensor its name, dims count u32, dims u64 (GGUF's ne
order, fastest first), type u32 and offset u64 from the data start, which is the end of the index
rounded up to general.alignment (default 32). Every inconsistency raises ValueError.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
STRING, ARRAY = 8, 9
SCALARS = {kind: struct.Struct("<" + code) for kind, code in
           {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}.items()}
TYPED = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
         "I32": np.int32, "I64": np.int64}   # tensor types viewed as values; the rest as bytes
_U32, _U64 = SCALARS[4], SCALARS[10]


@dataclass(frozen=True)
class HeaderTensor:
    name: str
    type_id: int                  # ggml type number (GGMLQuantizationType)
    dims: tuple[int, ...]         # GGUF's ne order: the fastest-varying dimension first
    offset: int                   # where its bytes start in the file
    data: np.ndarray              # a view of the map: values (F32, F16, ...) or the raw blocks


@dataclass(frozen=True)
class Header:
    metadata: dict                # key -> str, int, float, bool, or a list of them
    tensors: list[HeaderTensor]


class _Cursor:
    """Reads values in order from a buffer (the file's map)."""

    def __init__(self, buf: memoryview):
        self.buf, self.at = buf, 0

    def take(self, form: struct.Struct):
        self.at += form.size
        return form.unpack_from(self.buf, self.at - form.size)[0]

    def strings(self, count: int) -> list[str]:
        """count strings (u64 length, UTF-8 bytes), the loop's lookups hoisted: a vocabulary is
        300k of them. A slice past the end comes back short; the final position tells."""
        buf, at, unpack, out = self.buf, self.at, _U64.unpack_from, []
        for _ in range(count):
            n = unpack(buf, at)[0]
            out.append(str(buf[at + 8:at + 8 + n], "utf-8"))
            at += 8 + n
        self._need(at - self.at)
        self.at = at
        return out

    def value(self, kind: int):
        if kind == STRING:
            return self.strings(1)[0]
        if kind in SCALARS:
            return self.take(SCALARS[kind])
        if kind != ARRAY:
            raise ValueError(f"unknown value type {kind} before byte {self.at}")
        kind, count = self.take(_U32), self.take(_U64)
        if kind == STRING:
            return self.strings(count)
        if kind not in SCALARS:                              # arrays of arrays: flattened, as gguf-py
            return [item for _ in range(count) for item in _listed(self.value(kind))]
        dtype = np.dtype(SCALARS[kind].format)
        self._need(count * dtype.itemsize)
        self.at += count * dtype.itemsize
        return np.frombuffer(self.buf, dtype, count, self.at - count * dtype.itemsize).tolist()

    def _need(self, n: int) -> None:
        if self.at + n > len(self.buf):
            raise ValueError(f"a value of {n} bytes at byte {self.at} runs past the end ({len(self.buf)} bytes)")


def _listed(value) -> list:
    return value if isinstance(value, list) else [value]


def read_header(path) -> Header:
    """The metadata and the tensor index of one GGUF file; ValueError (or struct.error) on a file
    that is not one, or is cut short."""
    data = np.memmap(path, mode="r")
    cur = _Cursor(memoryview(data))
    if bytes(cur.buf[:4]) != MAGIC:
        raise ValueError("no GGUF magic")
    cur.at = 4
    version = cur.take(_U32)
    if version not in VERSIONS:
        raise ValueError(f"GGUF version {version} (FreeToken reads {', '.join(map(str, VERSIONS))}; "
                         "a big-endian file shows as a huge version)")
    tensor_count, key_count = cur.take(_U64), cur.take(_U64)
    metadata = {}
    for _ in range(key_count):
        key = cur.value(STRING)
        if key in metadata:
            raise ValueError(f"metadata key {key} appears twice")
        metadata[key] = cur.value(cur.take(_U32))
    index = [_index_entry(cur) for _ in range(tensor_count)]
    start = _data_start(cur.at, metadata)
    return Header(metadata, _tensors(data, index, start))


def _index_entry(cur: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
    name = cur.value(STRING)
    dims = tuple(cur.take(_U64) for _ in range(cur.take(_U32)))
    return name, dims, cur.take(_U32), cur.take(_U64)


def _data_start(end_of_index: int, metadata: dict) -> int:
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"general.alignment {alignment!r} is not a power of two")
    return -(-end_of_index // alignment) * alignment


def _tensors(data: np.memmap, index: list, start: int) -> list[HeaderTensor]:
    """Each tensor's bytes as GGUFReader views them: values of its numpy type for the plain
    types, else bytes shaped [..., row bytes] (gguf.quants.quant_shape_to_byte_shape)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape
    out, seen = [], set()
    for name, dims, type_id, offset in index:
        if name in seen:
            raise ValueError(f"tensor {name} appears twice")
        seen.add(name)
        kind = GGMLQuantizationType(type_id)            # ValueError for a type number gguf does not know
        block, block_bytes = GGML_QUANT_SIZES[kind]
        count, shape = int(np.prod(dims)), tuple(reversed(dims))
        at, nbytes = start + offset, count * block_bytes // block
        if at + nbytes > data.shape[0]:
            raise ValueError(f"tensor {name}'s {nbytes} bytes at byte {at} run past the end ({data.shape[0]} bytes)")
        dtype = TYPED.get(kind.name)
        view = data[at:at + nbytes].view(dtype) if dtype else data[at:at + nbytes]
        out.append(HeaderTensor(name, type_id, dims, at,
                                view.reshape(shape if dtype else quant_shape_to_byte_shape(shape, kind))))
    return out
