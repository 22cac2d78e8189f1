"""Shared test helpers: ``assert_close`` reports where two arrays disagree, not only that they
do."""
import numpy as np


def close_report(name, ref, out, atol, rtol):
    """(ok, one-line report): max abs and rel error, the worst index and both values there."""
    ref = np.asarray(ref, np.float64)
    out = np.asarray(out, np.float64)
    if ref.shape != out.shape:
        return False, f"{name}: shape {out.shape} != reference {ref.shape}"
    if ref.size == 0:
        return True, f"{name}: empty"
    err = np.abs(out - ref)
    err = np.where(np.isnan(ref) & np.isnan(out), 0.0, np.where(np.isnan(err), np.inf, err))
    excess = err - (atol + rtol * np.abs(ref))
    worst = np.unravel_index(int(np.argmax(excess)), ref.shape)
    rel = err / np.maximum(np.abs(ref), np.finfo(np.float32).tiny)
    report = (f"{name}: max abs {err.max():.3g}, max rel {rel.max():.3g} (atol {atol:g}, "
              f"rtol {rtol:g}); worst at {tuple(int(i) for i in worst)}: "
              f"ref {ref[worst]!r}, out {out[worst]!r}")
    return bool(excess.max() <= 0), report


def assert_close(name, ref, out, atol, rtol):
    """Assert |out - ref| <= atol + rtol * |ref| elementwise; prints the report either way."""
    ok, report = close_report(name, ref, out, atol, rtol)
    print(report)
    assert ok, report


def assert_launches(call, expected):
    """Run ``call()`` and assert it launched exactly ``expected`` kernels, counted by the emulated
    device (freetoken.cuda_emu.kernels.launches). A real GPU keeps no count: there the call only
    runs, and a zero-grid launch is the driver's error (CUDA rejects a zero grid dimension)."""
    from freetoken.cupy_loader import emulated
    if not emulated():
        call()
        return
    from freetoken.cuda_emu import kernels
    before = kernels.launches
    call()
    assert kernels.launches - before == expected, (
        f"launched {kernels.launches - before} kernels, expected {expected}")


def assert_follows_ref(want, got, rtol=1e-5, atol=1e-6):
    """NaN exactly where ref has NaN; every other element close to ref (infinities equal)."""
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got[~np.isnan(want)], want[~np.isnan(want)], rtol=rtol, atol=atol)
