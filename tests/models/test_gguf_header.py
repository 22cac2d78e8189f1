"""models/gguf_header.py against gguf-py's GGUFReader (the reference reader): the same metadata,
tensor index and tensor views on every GGUF fixture and on a file with every value type; and a
cut-short or inconsistent file is one GGUFError through open_gguf, at every cut."""
from pathlib import Path

import numpy as np
import pytest

from freetoken.models.gguf_file import GGUFError, open_gguf
from freetoken.models.gguf_header import read_header

FIXTURES = sorted((Path(__file__).parent.parent / "fixtures" / "gguf").glob("*.gguf"))


def _reference(path):
    """GGUFReader's view: (metadata, [(name, type, dims, offset, data)])."""
    from gguf import GGUFReader
    reader = GGUFReader(path, "r")
    metadata = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    return metadata, [(t.name, int(t.tensor_type), tuple(int(n) for n in t.shape), int(t.data_offset), t.data)
                      for t in reader.tensors]


def _assert_same_as_reference(path):
    want_metadata, want_tensors = _reference(path)
    header = read_header(path)
    assert header.metadata == want_metadata
    assert [type(v) for v in header.metadata.values()] == [type(v) for v in want_metadata.values()]
    got = [(t.name, t.type_id, t.dims, t.offset, t.data) for t in header.tensors]
    assert [g[:4] for g in got] == [w[:4] for w in want_tensors]
    for (*_, a), (*_, b) in zip(got, want_tensors):
        assert a.dtype == b.dtype and a.shape == b.shape and not a.flags.writeable
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.parametrize("path", FIXTURES, ids=[p.name for p in FIXTURES])
def test_every_fixture_reads_as_gguf_py_reads_it(path):
    _assert_same_as_reference(path)


def _every_type(path: Path, alignment: int = 64) -> Path:
    """A file with every scalar type, arrays, and plain tensors (the fixtures hold the block types)."""
    import gguf as g
    w = g.GGUFWriter(str(path), "qwen3moe")
    w.add_custom_alignment(alignment)
    for name in ("uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64"):
        getattr(w, f"add_{name}")(f"t.{name}", 7)
    w.add_float32("t.f32", 0.1)
    w.add_float64("t.f64", 0.1)
    w.add_bool("t.bool", True)
    w.add_string("t.text", "héllo ✓")
    w.add_array("t.ints", [1, -2, 3])
    w.add_array("t.floats", [0.5, 1.5])
    w.add_array("t.words", ["a", "", "ü" * 300])
    w.add_array("t.empty", [])
    rng = np.random.default_rng(0)
    w.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16", rng.standard_normal((2, 7)).astype(np.float16))
    w.add_tensor("i32", np.arange(9, dtype=np.int32).reshape(3, 3))
    for step in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        step()
    return path


def test_every_value_type_and_an_alignment_read_as_gguf_py_reads_them(tmp_path):
    path = _every_type(tmp_path / "types.gguf")
    _assert_same_as_reference(path)
    header = read_header(path)
    assert header.metadata["t.words"] == ["a", "", "ü" * 300] and header.metadata["t.bool"] is True
    assert all(t.offset % 64 == 0 for t in header.tensors)
    assert [t.data.shape for t in header.tensors] == [(3, 5), (2, 7), (3, 3)]


def test_a_file_cut_anywhere_is_one_clear_error(tmp_path):
    path = _every_type(tmp_path / "whole.gguf")
    whole, tensors = path.read_bytes(), read_header(path).tensors
    cut = tmp_path / "cut.gguf"
    for end in list(range(0, tensors[0].offset, 5)) + [tensors[-1].offset + tensors[-1].data.nbytes - 1]:
        cut.write_bytes(whole[:end])
        with pytest.raises(GGUFError, match="not a readable GGUF file") as e:
            open_gguf(cut)
        assert str(cut) in str(e.value)


@pytest.mark.parametrize("change,message", [
    ((b"t.uint32", b"t.uint16"), "key t.uint16 appears twice"),
    ((b"\x04\x00\x00\x00\x40\x00\x00\x00", b"\x04\x00\x00\x00\x30\x00\x00\x00"), "not a power of two"),   # alignment 48
    ((b"\x03" + bytes(7) + b"f16", b"\x03" + bytes(7) + b"f32"), "tensor f32 appears twice"),
])
def test_inconsistent_headers_are_refused(tmp_path, change, message):
    data = _every_type(tmp_path / "types.gguf").read_bytes()
    assert data.count(change[0]) == 1
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(data.replace(*change))
    with pytest.raises(GGUFError, match=message):
        open_gguf(bad)
