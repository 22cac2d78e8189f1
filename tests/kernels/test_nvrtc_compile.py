"""Every cuda/*.cu compiles with NVRTC for sm_80 and sm_90, without a GPU and without CuPy
(the loader's options and #line prefix included). Skipped only when libnvrtc is absent."""
import pytest

from freetoken.kernels import _cuda, _nvrtc

ARCHS = ("sm_80", "sm_90")
SOURCES = sorted(_cuda.cuda_dir().glob("*.cu"))


def _need_nvrtc():
    if _nvrtc.nvrtc() is None:
        pytest.skip("libnvrtc not found (pip install 'nvidia-cuda-nvrtc==13.0.*')")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("path", SOURCES, ids=[p.name for p in SOURCES])
def test_compiles(path, arch):
    _need_nvrtc()
    ptx = _nvrtc.compile_to_ptx(path, arch)
    assert f".target {arch}".encode() in ptx
    assert b".entry" in ptx or b".visible .entry" in ptx


def test_error_names_the_file(tmp_path):
    """The #line prefix makes NVRTC report the real path and line of a broken kernel."""
    _need_nvrtc()
    bad = tmp_path / "broken.cu"
    bad.write_text('#include "common.cuh"\n\nextern "C" __global__ void f() { undeclared(); }\n')
    (tmp_path / "common.cuh").write_text("#pragma once\n")
    with pytest.raises(RuntimeError) as err:
        _nvrtc.compile_to_ptx(bad, "sm_90")
    assert f"{bad}(3)" in str(err.value), str(err.value)
