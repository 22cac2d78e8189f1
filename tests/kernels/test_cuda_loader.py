"""kernels/_cuda.py's module text: CuPy caches compiled kernels by the code text alone, so the text
RawModule gets carries a digest of the headers, and an edited .cuh means a new binary."""
import shutil

from freetoken.kernels import _cuda


def test_an_edited_header_changes_the_module_text(tmp_path):
    for f in _cuda.cuda_dir().iterdir():
        if f.suffix in (".cu", ".cuh"):
            shutil.copy(f, tmp_path / f.name)
    before = _cuda.module_source(tmp_path / "rms_norm.cu")
    assert before.startswith('#line 1 "') and "freetoken headers" in before
    assert _cuda.module_source(tmp_path / "rms_norm.cu") == before          # stable
    (tmp_path / "common.cuh").write_text((tmp_path / "common.cuh").read_text() + "\n// edited\n")
    after = _cuda.module_source(tmp_path / "rms_norm.cu")
    assert after != before and after.split("freetoken headers")[0] == before.split("freetoken headers")[0]
