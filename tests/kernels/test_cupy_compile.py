"""tools/cupy_compile.py against a recording stand-in of CuPy's compiler: the options RawModule
would pass, the arch named without a device query (and the query put back), a failed compile or a
cubin without an entry point reported by source, arch and defines. CI runs the module itself
against the real CuPy of the cuda13 extra (.ci/run)."""
import types

import pytest

from freetoken.device_limits import cuda_dir, table
from tools import cupy_compile


def _device_query(arch=None):
    raise RuntimeError("cudaErrorInsufficientDriver")     # what CuPy's own query does here


class FakeCompiler:
    def __init__(self, cubin_for):
        self.cubin_for, self.calls = cubin_for, []
        self._get_arch_for_options_for_nvrtc = _device_query

    def compile_using_nvrtc(self, source, options, arch):
        flag, method = self._get_arch_for_options_for_nvrtc(arch)
        self.calls.append((source, options, arch, flag, method))
        return self.cubin_for(source, options), {}


def _fake_cupy(cubin_for):
    compiler = FakeCompiler(cubin_for)
    core = types.SimpleNamespace(assemble_cupy_compiler_options=lambda o: ("-Icupy",) + o)
    return types.SimpleNamespace(cuda=types.SimpleNamespace(compiler=compiler),
                                 _core=types.SimpleNamespace(core=core))


def _all_entries(path):
    return b" ".join(e.encode() for e, row in table().items() if row["file"] == path.name)


def test_options_arch_and_the_device_query_put_back():
    path = cuda_dir() / "router.cu"
    cp = _fake_cupy(lambda source, options: _all_entries(path))
    with cupy_compile.named_arch(cp.cuda.compiler):
        cubin = cupy_compile.compile_source(cp, path, "sm_90", ("-DX=1",))
    assert cupy_compile.missing_entries(path, cubin) == []
    source, options, arch, flag, method = cp.cuda.compiler.calls[0]
    assert options[0] == "-Icupy" and options[-2:] == ("-DX=1", "-ftz=true")
    assert "-std=c++17" in options and f"-I{cuda_dir()}" in options
    assert (arch, flag, method) == ("90", "-arch=sm_90", "cubin")
    assert "freetoken headers" in source                 # module_source: what RawModule compiles
    assert cp.cuda.compiler._get_arch_for_options_for_nvrtc is _device_query


def test_failures_name_the_source_arch_and_defines():
    def cubin_for(source, options):
        if "-DQFMT=3" in options:
            raise RuntimeError("qblocks.cuh(12): error: identifier undefined")
        return b"" if 'gdn_rule.cu"' in source else b"every entry? no"
    lines = cupy_compile.check(_fake_cupy(cubin_for), archs=("sm_80",))
    assert any(line.startswith("qblocks.cu sm_80 -DQFMT=3: RuntimeError") for line in lines), lines
    assert any(line.startswith("gdn_rule.cu sm_80: no entry point gdn_rule") for line in lines)


def test_refuses_the_emulated_device(monkeypatch):
    monkeypatch.setenv("FREETOKEN_CUDA_EMULATE", "1")
    with pytest.raises(SystemExit, match="real CuPy"):
        cupy_compile.main([])
