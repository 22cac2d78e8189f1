"""Safetensors without torch: the reader (header checks, tensors read straight into arrays the
caller owns, runs of tensors adjacent in the file in one scattered read), the writer, and a model
directory's tensors (single file or sharded) by canonical name."""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np

from freetoken.kernels._bf16 import from_f32

# safetensors dtype tag -> how the bytes are viewed (little-endian by the format's definition)
_STORED = {"BF16": np.dtype("<u2"), "F16": np.dtype("<f2"), "F32": np.dtype("<f4"),
           "F8_E4M3": np.dtype("u1"),    # block-FP8 codes: models/fp8_weights.py
           "U8": np.dtype("u1")}         # MXFP4 blocks and exponents: models/gpt_oss_weights.py
_INFER_TAG = {np.dtype(np.uint16): "BF16", np.dtype(np.float16): "F16", np.dtype(np.float32): "F32",
              np.dtype(np.uint8): "U8"}
_SCATTER = hasattr(os, "preadv")      # POSIX; elsewhere one readinto per tensor
_IOV_MAX = 1024                     # buffers one preadv may take (Linux's IOV_MAX)
_PREFIXES = (("model.language_model.", "model."), ("language_model.", ""))


class WeightsError(ValueError):
    """A checkpoint FreeToken cannot load: missing or mis-shaped tensor, bad file, unknown dtype."""


class SafetensorsFile:
    """One .safetensors file: header parsed here; tensors read from the file on demand.

    Tensors are read with plain file reads into arrays the caller owns (no memory map): a mapped
    file's pages count in the process's RSS for as long as any view of them lives, so a model
    whose experts are restacked would be resident twice (the mapping beside the copy)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise WeightsError(f"{self.path}: too short to be a safetensors file")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise WeightsError(f"{self.path}: header length {n} exceeds the file size {size}")
            try:
                header = json.loads(f.read(n))
            except ValueError as e:
                raise WeightsError(f"{self.path}: header is not valid JSON ({e})") from None
        header.pop("__metadata__", None)
        self.entries: dict[str, dict] = header
        self._data_start = 8 + n
        self._data_size = size - 8 - n

    def _located(self, name: str) -> tuple[str, tuple, int]:
        """(dtype tag, shape, offset of the data in the file) of a tensor, its entry checked."""
        meta = self.entries[name]
        tag, shape = meta["dtype"], tuple(meta["shape"])
        if tag not in _STORED:
            raise WeightsError(f"{self.path}: tensor {name!r} has dtype {tag}; "
                               f"supported: {', '.join(_STORED)}")
        begin, end = meta["data_offsets"]
        want = int(np.prod(shape, dtype=np.int64)) * _STORED[tag].itemsize
        if end - begin != want or end > self._data_size or begin < 0:
            raise WeightsError(f"{self.path}: tensor {name!r} has data_offsets {begin}..{end}, "
                               f"expected {want} bytes for shape {shape} {tag} within {self._data_size}")
        return tag, shape, self._data_start + begin

    def takes_directly(self, name: str, out: np.ndarray | None) -> bool:
        """Whether tensor `name` can be read as it is into `out` (stored dtype and shape)."""
        tag, shape, _ = self._located(name)
        return (out is not None and tag != "F16" and out.dtype == _STORED[tag] and out.shape == shape
                and out.flags.c_contiguous and out.flags.writeable)

    def get(self, name: str, out: np.ndarray | None = None) -> np.ndarray:
        """The tensor as stored, read into `out` (C-contiguous, the stored dtype and shape) or
        into a new array; F16 is widened to float32 (never into `out`)."""
        tag, shape, offset = self._located(name)
        dest = out if self.takes_directly(name, out) else np.empty(shape, _STORED[tag])
        self.read_runs([(offset, dest)])
        return dest.astype(np.float32) if tag == "F16" else dest

    def read_many(self, pairs: list[tuple[str, np.ndarray]]) -> None:
        """Read each tensor straight into its array (takes_directly must hold for each). Tensors
        next to each other in the file are read by one scattered read (os.preadv): a layer's
        experts are a few calls instead of hundreds, and the GIL is released for all of it."""
        self.read_runs([(self._located(name)[2], out) for name, out in pairs])

    def read_runs(self, spans: list[tuple[int, np.ndarray]]) -> None:
        """(file offset, C-contiguous array) pairs read in: adjacent spans share a read."""
        read_spans(self.path, spans)


def read_spans(path, spans: list[tuple[int, np.ndarray]]) -> None:
    """(file offset, C-contiguous array) pairs of `path` read straight into the arrays; spans next
    to each other in the file share one scattered read (os.preadv), which releases the GIL."""
    spans = sorted(spans, key=lambda s: s[0])
    with open(path, "rb", buffering=0) as f:
        run, run_at, end = [], 0, -1
        for offset, dest in spans:
            view = memoryview(dest.reshape(-1).view(np.uint8))
            if offset != end or not _SCATTER:
                _read_run(path, f, run, run_at)
                run, run_at = [], offset
            run.append(view)
            end = offset + len(view)
        _read_run(path, f, run, run_at)


def _read_run(path, f, views: list, offset: int) -> None:
    """Fill views in order from the file bytes at offset; a read may return less than asked
    (Linux caps one near 2 GiB), so go on from where it stopped."""
    views, i = [v for v in views if len(v)], 0
    while i < len(views):
        if _SCATTER:
            got = os.preadv(f.fileno(), views[i:i + _IOV_MAX], offset)
        else:
            f.seek(offset)
            got = f.readinto(views[i])
        if not got:
            raise WeightsError(f"{path}: file ended {sum(map(len, views[i:]))} bytes early")
        offset += got
        while got and i < len(views):
            take = min(got, len(views[i]))
            views[i], got = views[i][take:], got - take
            i += not len(views[i])


class Checkpoint:
    """Every tensor of a model directory (single file or sharded), by canonical name.

    Canonical names drop a leading `model.language_model.` (-> `model.`) or `language_model.`.
    """

    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        self._where: dict[str, tuple[SafetensorsFile, str]] = {}
        for path in _shard_paths(self.model_dir):
            shard = SafetensorsFile(path)
            for raw in shard.entries:
                self._where.setdefault(canonical_name(raw), (shard, raw))

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def names(self) -> list[str]:
        return sorted(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        shard, raw = self._where[name]
        return tuple(shard.entries[raw]["shape"])

    def stored_dtype(self, name: str) -> str:
        shard, raw = self._where[name]
        return shard.entries[raw]["dtype"]

    def _entry(self, name: str, shape: tuple[int, ...]) -> tuple[SafetensorsFile, str]:
        """The shard and raw name of tensor `name`; WeightsError when it is missing or when its
        shape is not `shape` (naming both)."""
        if name not in self._where:
            raise WeightsError(f"{self.model_dir}: missing tensor {name!r} "
                               f"(expected shape {tuple(shape)}, found none)")
        shard, raw = self._where[name]
        found = tuple(shard.entries[raw]["shape"])
        if found != tuple(shape):
            raise WeightsError(f"{shard.path}: tensor {raw!r} has the wrong shape: "
                               f"expected {tuple(shape)}, found {found}")
        return shard, raw

    def get(self, name: str, shape: tuple[int, ...], out: np.ndarray | None = None) -> np.ndarray:
        """The tensor `name` checked against `shape` (read into `out` when it fits, see
        SafetensorsFile.get)."""
        shard, raw = self._entry(name, shape)
        return shard.get(raw, out)

    def read_many(self, items: list[tuple[str, tuple, np.ndarray]]) -> list:
        """Read every (name, shape, out) that can go straight into `out`, shard by shard in
        scattered reads (SafetensorsFile.read_many); returns the items left over (stored in
        another dtype), for the caller to convert."""
        by_shard: dict = {}
        left = []
        for name, shape, out in items:
            shard, raw = self._entry(name, shape)
            if shard.takes_directly(raw, out):
                by_shard.setdefault(shard, []).append((raw, out))
            else:
                left.append((name, shape, out))
        for shard, pairs in by_shard.items():
            shard.read_many(pairs)
        return left

    def bf16_majority(self) -> bool:
        """True when BF16 holds most of the checkpoint's bytes (decides the model dtype)."""
        sizes = {tag: 0 for tag in _STORED}
        for shard, raw in self._where.values():
            meta = shard.entries[raw]
            if meta["dtype"] in sizes:
                sizes[meta["dtype"]] += meta["data_offsets"][1] - meta["data_offsets"][0]
        return sizes["BF16"] > 0 and sizes["BF16"] >= sizes["F16"] + sizes["F32"]


def canonical_name(name: str) -> str:
    for prefix, repl in _PREFIXES:
        if name.startswith(prefix):
            return repl + name[len(prefix):]
    return name


def _shard_paths(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map") or {}
        files = sorted(set(weight_map.values()))
        missing = [f for f in files if not (model_dir / f).is_file()]
        if missing:
            raise WeightsError(f"{index}: shard file(s) not found: {', '.join(missing)}")
        return [model_dir / f for f in files]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(model_dir.glob("*.safetensors"))
    if not found:
        raise WeightsError(f"{model_dir}: no model.safetensors, index or *.safetensors file")
    return found


def save_safetensors(path: str | Path, tensors: dict[str, np.ndarray],
                     dtypes: str | dict[str, str] | None = None,
                     metadata: dict[str, str] | None = None) -> None:
    """Write a safetensors file. `dtypes`: one tag for all, {name: tag}, or None to infer
    (uint16 -> BF16, float16 -> F16, float32 -> F32, uint8 -> U8). BF16 takes uint16 bits as they are and
    rounds float input to nearest even."""
    tags = {name: _tag_for(name, tensors[name], dtypes) for name in tensors}
    # Largest element first keeps every tensor aligned to its element size.
    order = sorted(tensors, key=lambda n: (-_STORED[tags[n]].itemsize, n))
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    for name in order:
        nbytes = int(np.prod(tensors[name].shape, dtype=np.int64)) * _STORED[tags[name]].itemsize
        header[name] = {"dtype": tags[name], "shape": list(tensors[name].shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data section starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for name in order:  # convert one tensor at a time: peak memory is one tensor
            f.write(np.ascontiguousarray(_encode(tensors[name], tags[name])).data)


def _tag_for(name: str, arr: np.ndarray, dtypes) -> str:
    tag = dtypes.get(name) if isinstance(dtypes, dict) else dtypes
    tag = tag or _INFER_TAG.get(np.asarray(arr).dtype)
    if tag not in _STORED:
        raise WeightsError(f"tensor {name!r}: cannot store dtype {np.asarray(arr).dtype} as {tag}; "
                           f"supported: {', '.join(_STORED)}")
    return tag


def _encode(arr: np.ndarray, tag: str) -> np.ndarray:
    arr = np.asarray(arr)
    if tag == "BF16":
        return arr.astype("<u2") if arr.dtype == np.uint16 else from_f32(arr.astype(np.float32))
    return arr.astype(_STORED[tag])
