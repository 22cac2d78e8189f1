"""A GGUF file (llama.cpp's format), its header read by models/gguf_header.py (memory mapped; gguf-py,
llama.cpp's own package, for the format's constants and block sizes): a split set given by its
first part, the metadata as plain values, the tensors by name, and every failure as one GGUFError
naming the file and what is wrong.

Types FreeToken reads are SUPPORTED_TYPES (everything Q4_K_M, Q5_K_M, Q6_K, Q8_0, MXFP4_MOE and the
`UD-*` mixes hold); any other type is one error naming the tensor, its type and the supported list.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from freetoken.config import ConfigError

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "MXFP4")    # MXFP4: llama-quantize's MXFP4_MOE
SPLIT = re.compile(r"^(?P<stem>.*)-(?P<part>\d{5})-of-(?P<count>\d{5})\.gguf$")


class GGUFError(ConfigError):
    """A GGUF file FreeToken cannot read; the message names the file and what is wrong."""


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    type_name: str            # GGMLQuantizationType name, e.g. "Q4_K"
    shape: tuple[int, ...]    # numpy order (rows last-varying): the reverse of GGUF's ne
    data: object              # the raw blocks or values, a view of the memory map
    file: Path
    offset: int = 0           # where data starts in `file`


@dataclass(frozen=True)
class GGUFModel:
    """Every part of one GGUF model: its metadata and its tensors."""

    paths: tuple[Path, ...]
    metadata: dict
    tensors: dict[str, GGUFTensor]

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def key(self, name: str, default=None):
        """A key of this architecture: key("block_count") is "<arch>.block_count"."""
        return self.metadata.get(f"{self.architecture}.{name}", default)

    def require(self, name: str, of_architecture: bool = True):
        """A metadata key the model cannot do without; GGUFError naming it when it is absent."""
        full = f"{self.architecture}.{name}" if of_architecture else name
        if self.metadata.get(full) is None:
            raise GGUFError(f"{self.paths[0]}: metadata key {full} is missing")
        return self.metadata[full]

    @property
    def bf16(self) -> bool:
        """The file's weights are mostly bf16 (by bytes): the model is widened to bf16, else fp32."""
        total = sum(t.data.nbytes for t in self.tensors.values())
        return 2 * sum(t.data.nbytes for t in self.tensors.values() if t.type_name == "BF16") > total


def is_gguf(path: str | Path) -> bool:
    return str(path).endswith(".gguf")


def check_path(path: str | Path) -> Path:
    """The file to open, its split set complete; GGUFError otherwise (before anything is read)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise GGUFError(f"{path}: no such file")
    split_parts(path)
    return path


def split_parts(path: Path) -> tuple[Path, ...]:
    """The parts of a split set given by its first part (NAME-00001-of-0000N.gguf), else (path,)."""
    m = SPLIT.match(path.name)
    if m is None:
        return (path,)
    count = int(m["count"])
    if int(m["part"]) != 1:
        raise GGUFError(f"{path}: give the first part of a split set ({m['stem']}-00001-of-{m['count']}.gguf)")
    parts = tuple(path.with_name(f"{m['stem']}-{i:05d}-of-{m['count']}.gguf") for i in range(1, count + 1))
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise GGUFError(f"{path}: the split set has {count} parts; missing: {', '.join(missing)}")
    return parts


def open_gguf(path: str | Path) -> GGUFModel:
    """Read the metadata and tensor index of a GGUF model (every part of a split set)."""
    path = check_path(path)
    metadata, tensors = {}, {}
    parts = split_parts(path)
    for part in parts:
        header = _header(part)
        if part == parts[0]:
            metadata = header.metadata
            _check_split_count(path, metadata, len(parts))
        for t in header.tensors:
            if t.name in tensors:
                raise GGUFError(f"{part}: tensor {t.name} is also in {tensors[t.name].file.name}")
            tensors[t.name] = _tensor(t, part)
    return GGUFModel(parts, metadata, tensors)


def _check_split_count(path: Path, metadata: dict, parts: int) -> None:
    """A split set's first part says how many parts there are (split.count): a renamed set, or one
    file given where a set was written, is refused rather than read short."""
    count = metadata.get("split.count")
    if count is not None and int(count) != parts:
        raise GGUFError(f"{path}: the file is part 1 of a split set of {count} (split.count); give the set's "
                        f"first part under its NAME-00001-of-{int(count):05d}.gguf name, with the other parts beside it")


def _header(path: Path):
    from struct import error as StructError
    from freetoken.models.gguf_header import read_header
    try:
        return read_header(path)
    except (ValueError, OSError, StructError) as e:
        raise GGUFError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


def _tensor(t, path: Path) -> GGUFTensor:
    from gguf import GGMLQuantizationType
    type_name = GGMLQuantizationType(t.type_id).name       # an unknown type fails in read_header
    if type_name not in SUPPORTED_TYPES:
        raise GGUFError(f"{path}: tensor {t.name} is {type_name}; FreeToken reads {', '.join(SUPPORTED_TYPES)}")
    return GGUFTensor(t.name, type_name, tuple(reversed(t.dims)), t.data, path, t.offset)
