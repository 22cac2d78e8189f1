"""Launch order cannot drift: every ``extern "C" __global__`` signature in cuda/*.cu matches the
``ARGS`` declaration its wrapper binds arguments with, and the wrappers themselves run up to the
launch on host arrays (the launch recorded instead of made), all without a GPU."""
import importlib
import pkgutil
import re

import numpy as np
import pytest

import freetoken.kernels as kernels_pkg
from freetoken.cuda_emu.device_launch import entries
from freetoken.kernels import _cuda, cases

C_TYPES = {  # C parameter type (const and __restrict__ dropped) -> ARGS type tag
    "float*": "f32*", "u16*": "u16*", "unsigned short*": "u16*", "int*": "i32*",
    "u32*": "u32*", "unsigned int*": "u32*", "long long*": "i64*", "unsigned char*": "u8*", "u8*": "u8*",
    "int": "i32", "u32": "u32", "unsigned int": "u32", "long long": "i64", "float": "f32",
}
# ops whose gpu wrapper this file dry-runs on numpy arrays (their builders live in cases.py)
DRY_RUN = ("embedding", "rms_norm", "add_rms_norm", "rope", "kv_write", "router", "sampling",
           "penalties", "logprobs", "gdn_conv", "gdn_rule", "gated_rms_norm", "sigmoid_mul")


def _param(p):
    """device_launch.Param of 'const float* __restrict__ x' -> 'x:f32*'."""
    ctype = p.ctype.replace(" *", "*")
    assert ctype in C_TYPES, f"parameter {p.name}: type {ctype!r} has no ARGS tag"
    return f"{p.name}:{C_TYPES[ctype]}"


def cuda_entries():
    """{entry: (file name, ('name:tag', ...))} over every cuda/*.cu."""
    found = {}
    for path in sorted(_cuda.cuda_dir().glob("*.cu")):
        for name, params in entries(path.read_text()).items():
            assert name not in found, f"{name} defined in {found[name][0]} and {path.name}"
            decl = tuple(_param(p) for p in params)
            found[name] = (path.name, decl)
    return found


# Wrappers of kernels that are not ops (the MoE residency step) live beside their policy code.
EXTRA_WRAPPERS = ("freetoken.moe.residency_gpu",)


def declared_args():
    """{entry: (module, ARGS tuple)} over every wrapper module with an ARGS table."""
    found = {}
    names = [f"freetoken.kernels.{i.name}" for i in pkgutil.iter_modules(kernels_pkg.__path__)]
    for name in names + list(EXTRA_WRAPPERS):
        module = importlib.import_module(name)
        for entry, decl in getattr(module, "ARGS", {}).items():
            assert entry not in found, f"{entry} declared in {found[entry][0]} and {name}"
            found[entry] = (name.rsplit(".", 1)[1], tuple(decl))
    return found


def test_every_entry_is_declared_in_launch_order():
    entries, declared = cuda_entries(), declared_args()
    for entry, (fname, params) in entries.items():
        assert entry in declared, f"{fname}: {entry} has no ARGS declaration in freetoken/kernels/"
        module, decl = declared[entry]
        assert decl == params, f"{entry}: {module}.ARGS {decl} != {fname} {params}"


def test_every_declaration_has_an_entry():
    entries = cuda_entries()
    stale = {e: m for e, (m, _) in declared_args().items() if e not in entries}
    assert not stale, f"ARGS entries with no kernel in cuda/*.cu: {stale}"


def test_declared_types_are_bindable():
    for entry, (module, decl) in declared_args().items():
        for item in decl:
            name, _, tag = item.partition(":")
            assert name.isidentifier(), (module, entry, item)
            assert tag in _cuda.POINTER_DTYPES or tag in _cuda.SCALAR_TYPES, (module, entry, item)


def test_entry_names_follow_op_variant_dtype():
    """..._bf16 / _f16 / _f32 / _i32 / _u8 by storage; _q: quantized blocks of the format the
    module was built for (-DQFMT, cuda/qblocks.cuh)."""
    for entry in cuda_entries():
        assert re.fullmatch(r"[a-z0-9_]+_(bf16|f16|f32|i32|u8|q)", entry), entry


@pytest.mark.parametrize("dtype", ["bf16", "f32"])
@pytest.mark.parametrize("op", DRY_RUN)
def test_wrapper_dry_run(op, dtype, monkeypatch):
    """gpu() on small odd-sized numpy inputs: asserts pass, every argument reaches the launch
    with the declared dtype or exact scalar type, and the geometry is whole warps."""
    launches = []

    class FakeKernel(tuple):               # (name, entry), with what a device reports of a kernel
        max_threads_per_block = 1024

    monkeypatch.setattr(_cuda, "kernel", lambda name, entry, defines=(): FakeKernel((name, entry)))
    monkeypatch.setattr(_cuda, "launch", lambda k, grid, block, args, shared_mem=0:
                        launches.append((k, grid, block, args, shared_mem)))
    defaults, _ = cases.OPS[op]
    small = {k: min(v, 37) if k not in ("k", "D", "R") else v for k, v in defaults.items()}
    case = cases.build(op, small, dtype, np.random.default_rng(1))
    module = importlib.import_module(f"freetoken.kernels.{op}")
    cases.run(module.gpu, case, np)
    assert len(launches) == 1
    (name, entry), grid, block, args, shared_mem = launches[0]
    decl = module.ARGS[entry]
    assert len(args) == len(decl)
    for item, a in zip(decl, args):
        tag = item.partition(":")[2]
        want = _cuda.POINTER_DTYPES.get(tag) or _cuda.SCALAR_TYPES[tag]
        assert (a.dtype if tag.endswith("*") else type(a)) == want, (entry, item, type(a))
    assert all(g > 0 for g in grid) and block[0] % 32 == 0 and 32 <= block[0] <= 1024, (grid, block)
    assert shared_mem <= 48 * 1024


def test_bind_rejects_wrong_dtype_and_unknown_names():
    x = np.zeros(4, np.float64)
    with pytest.raises(AssertionError, match="kernel wants f32"):
        _cuda.bind(("x:f32*",), x=x)
    with pytest.raises(AssertionError, match="not in the kernel signature"):
        _cuda.bind(("n:i32",), n=3, extra=1)
    assert type(_cuda.bind(("n:i32", "e:f32"), n=3, e=0.5)[0]) is np.int32


def test_dtype_tag():
    assert _cuda.dtype_tag(np.zeros(1, np.uint16)) == "bf16"
    assert _cuda.dtype_tag(np.zeros(1, np.float32)) == "f32"
    with pytest.raises(TypeError):
        _cuda.dtype_tag(np.zeros(1, np.float64))


def test_launch_names_the_failing_kernel_and_skips_empty_grids():
    calls = []

    class Fake:
        name = "fake_f32"

        def __call__(self, grid, block, args, shared_mem=0):
            calls.append(grid)
            raise ValueError("too many resources requested")

    _cuda.launch(Fake(), (0,), (32,), ())
    assert calls == []
    with pytest.raises(RuntimeError, match="fake_f32.*too many resources"):
        _cuda.launch(Fake(), (3,), (32,), ())
