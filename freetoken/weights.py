"""Safetensors reader/writer without torch, and the Qwen3-MoE loader producing ModelWeights.

Layout of ModelWeights/LayerWeights: docs/contracts.md. bf16 travels as uint16.
"""
from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from freetoken.config import ModelConfig
from freetoken.kernels._bf16 import from_f32, to_f32
from freetoken.progress import progress

# safetensors dtype tag -> how the bytes are viewed (little-endian by the format's definition)
_STORED = {"BF16": np.dtype("<u2"), "F16": np.dtype("<f2"), "F32": np.dtype("<f4")}
_INFER_TAG = {np.dtype(np.uint16): "BF16", np.dtype(np.float16): "F16", np.dtype(np.float32): "F32"}
_PREFIXES = (("model.language_model.", "model."), ("language_model.", ""))


class WeightsError(ValueError):
    """A checkpoint FreeToken cannot load: missing or mis-shaped tensor, bad file, unknown dtype."""


@dataclass(frozen=True, eq=False)
class LayerWeights:
    """One decoder layer. Dtype uint16 (bf16) or float32, the same for every array of a model."""

    input_norm: np.ndarray    # [H]
    post_norm: np.ndarray     # [H]
    qkv: np.ndarray           # [(Hq+2G)*D, H]  q rows, then k rows, then v rows
    o_proj: np.ndarray        # [H, Hq*D]
    q_norm: np.ndarray        # [D]
    k_norm: np.ndarray        # [D]
    router: np.ndarray | None  # [E, H]; None for dense-MLP layers
    gate_up: np.ndarray       # [E, 2I, H] gate rows first; dense-MLP layers [1, 2*I_dense, H]
    down: np.ndarray          # [E, H, I]; dense-MLP layers [1, H, I_dense]


@dataclass(frozen=True, eq=False)
class ModelWeights:
    embed: np.ndarray         # [V, H]
    final_norm: np.ndarray    # [H]
    lm_head: np.ndarray       # [V, H]; the embed array itself when tie_word_embeddings
    layers: tuple[LayerWeights, ...]


# --- safetensors ------------------------------------------------------------------------------

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

    def get(self, name: str, out: np.ndarray | None = None) -> np.ndarray:
        """The tensor as stored, read into `out` (C-contiguous, the stored dtype and shape) or
        into a new array; F16 is widened to float32 (never into `out`)."""
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
        direct = (out is not None and tag != "F16" and out.dtype == _STORED[tag] and out.shape == shape
                  and out.flags.c_contiguous and out.flags.writeable)
        dest = out if direct else np.empty(shape, _STORED[tag])
        self._read_into(self._data_start + begin, dest)
        return dest.astype(np.float32) if tag == "F16" else dest

    def _read_into(self, offset: int, dest: np.ndarray) -> None:
        view = memoryview(dest.reshape(-1).view(np.uint8))
        with open(self.path, "rb", buffering=0) as f:
            f.seek(offset)
            done = 0
            while done < len(view):          # one read may return less (Linux caps it near 2 GiB)
                got = f.readinto(view[done:])
                if not got:
                    raise WeightsError(f"{self.path}: file ended {len(view) - done} bytes early")
                done += got


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

    def get(self, name: str, shape: tuple[int, ...], out: np.ndarray | None = None) -> np.ndarray:
        """The tensor `name` checked against `shape` (read into `out` when it fits, see
        SafetensorsFile.get); WeightsError names both shapes when they differ."""
        if name not in self._where:
            raise WeightsError(f"{self.model_dir}: missing tensor {name!r} "
                               f"(expected shape {tuple(shape)}, found none)")
        shard, raw = self._where[name]
        found = tuple(shard.entries[raw]["shape"])
        if found != tuple(shape):
            raise WeightsError(f"{shard.path}: tensor {raw!r} has the wrong shape: "
                               f"expected {tuple(shape)}, found {found}")
        return shard.get(raw, out)

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
    (uint16 -> BF16, float16 -> F16, float32 -> F32). BF16 takes uint16 bits as they are and
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


# --- Qwen3-MoE loader ------------------------------------------------------------------------

def load_weights(model_dir: str | Path, cfg: ModelConfig, log=None) -> ModelWeights:
    """Load a Qwen3-MoE checkpoint (a hybrid's: hf_hybrid.py) into ModelWeights: uint16 when the
    checkpoint is (mostly) bf16, float32 otherwise; each tensor whose stored dtype matches is read
    from the file straight into its place in the final arrays (no mapping, no second copy)."""
    ck = Checkpoint(model_dir)
    dtype = np.dtype(np.uint16) if ck.bf16_majority() else np.dtype(np.float32)
    if cfg.is_hybrid:
        from freetoken.hf_hybrid import load_hybrid
        return load_hybrid(ck, cfg, dtype, log)
    V, H = cfg.vocab_size, cfg.hidden_size
    embed = _load(ck, "model.embed_tokens.weight", (V, H), dtype)
    lm_head = embed if cfg.tie_word_embeddings else _load(ck, "lm_head.weight", (V, H), dtype)
    layers = tuple(_load_layer(ck, cfg, i, dtype)
                   for i in progress(range(cfg.num_layers), cfg.num_layers, "loading layers"))
    return ModelWeights(embed=embed, final_norm=_load(ck, "model.norm.weight", (H,), dtype),
                        lm_head=lm_head, layers=layers)


def _load(ck: Checkpoint, name: str, shape: tuple[int, ...], dtype: np.dtype,
          out: np.ndarray | None = None) -> np.ndarray:
    """Tensor `name` in the model dtype, into `out` when given: read straight into it when the
    stored dtype matches, else read, converted and copied."""
    arr = ck.get(name, shape, out)
    if arr is out:
        return out
    if arr.dtype != dtype:
        arr = from_f32(arr) if dtype == np.uint16 else to_f32(arr)
    if out is None:
        return arr
    out[...] = arr.reshape(out.shape)
    return out


def _load_layer(ck: Checkpoint, cfg: ModelConfig, i: int, dtype: np.dtype) -> LayerWeights:
    p = f"model.layers.{i}."
    H, D, Hq, G = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    qkv = np.empty(((Hq + 2 * G) * D, H), dtype)  # [(Hq+2G)*D, H]
    for rows, (proj, heads) in zip(_row_slices(Hq * D, G * D, G * D),
                                   (("q", Hq), ("k", G), ("v", G))):
        _load(ck, f"{p}self_attn.{proj}_proj.weight", (heads * D, H), dtype, out=qkv[rows])
    if cfg.is_moe_layer(i):
        router = _load(ck, f"{p}mlp.gate.weight", (cfg.num_experts, H), dtype)
        gate_up, down = _expert_banks(ck, cfg, p, dtype)
    else:
        router = None
        gate_up, down = _dense_banks(ck, cfg, p, dtype)
    return LayerWeights(
        input_norm=_load(ck, f"{p}input_layernorm.weight", (H,), dtype),
        post_norm=_load(ck, f"{p}post_attention_layernorm.weight", (H,), dtype),
        qkv=qkv,
        o_proj=_load(ck, f"{p}self_attn.o_proj.weight", (H, Hq * D), dtype),
        q_norm=_load(ck, f"{p}self_attn.q_norm.weight", (D,), dtype),
        k_norm=_load(ck, f"{p}self_attn.k_norm.weight", (D,), dtype),
        router=router, gate_up=gate_up, down=down)


def _row_slices(*sizes: int) -> list[slice]:
    starts = np.cumsum((0,) + sizes)
    return [slice(int(a), int(b)) for a, b in zip(starts[:-1], starts[1:])]


def _expert_banks(ck: Checkpoint, cfg: ModelConfig, p: str,
                  dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """gate_up [E, 2I, H] (gate rows first) and down [E, H, I], each expert contiguous."""
    E, I, H = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    if f"{p}mlp.experts.gate_up_proj" in ck:  # transformers-5 packed layout is already ours
        return (_load(ck, f"{p}mlp.experts.gate_up_proj", (E, 2 * I, H), dtype),
                _load(ck, f"{p}mlp.experts.down_proj", (E, H, I), dtype))
    gate_up = np.empty((E, 2 * I, H), dtype)
    down = np.empty((E, H, I), dtype)
    for e in range(E):  # read into a preallocated bank: no list of copies, no np.stack
        q = f"{p}mlp.experts.{e}."
        _load(ck, f"{q}gate_proj.weight", (I, H), dtype, out=gate_up[e, :I])
        _load(ck, f"{q}up_proj.weight", (I, H), dtype, out=gate_up[e, I:])
        _load(ck, f"{q}down_proj.weight", (H, I), dtype, out=down[e])
    return gate_up, down


def _dense_banks(ck: Checkpoint, cfg: ModelConfig, p: str,
                 dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """A dense-MLP layer as a one-expert bank: gate_up [1, 2I, H], down [1, H, I]."""
    I, H = cfg.intermediate_size, cfg.hidden_size
    gate_up = np.empty((1, 2 * I, H), dtype)
    _load(ck, f"{p}mlp.gate_proj.weight", (I, H), dtype, out=gate_up[0, :I])
    _load(ck, f"{p}mlp.up_proj.weight", (I, H), dtype, out=gate_up[0, I:])
    down = _load(ck, f"{p}mlp.down_proj.weight", (H, I), dtype)[None]
    return gate_up, down
