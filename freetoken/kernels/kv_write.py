"""Store new K/V rows into the token-slot KV pool; pairs: cuda/kv_write.cu,
tests/kernels/test_kv_write.py."""
import numpy as np

from freetoken.kernels._bf16 import from_f32
from freetoken.kernels._numba import SERIAL, narrow, njit


def ref(k, v, k_cache, v_cache, slots):
    """k, v f32[T,G,D] -> k_cache[slots[t]], v_cache[slots[t]] ([N,G,D], bf16 bits or float);
    bf16 caches round to nearest even. Slots in one call are distinct."""
    for src, cache in ((k, k_cache), (v, v_cache)):
        src = np.asarray(src, np.float32)
        cache[np.asarray(slots)] = from_f32(src) if cache.dtype == np.uint16 else src


@njit(**SERIAL)
def _write(k, v, k_cache, v_cache, slots):
    """Every slot checked, then the rows written; returns the first bad slot's index or -1.
    Serial: a decode step writes 1-8 rows, where a parallel launch cost more than the copy, and
    a prefill chunk's copy is a fraction of a percent of its step."""
    for t in range(slots.shape[0]):
        if slots[t] < 0 or slots[t] >= k_cache.shape[0]:
            return t
    for t in range(k.shape[0]):
        for g in range(k.shape[1]):
            for d in range(k.shape[2]):
                k_cache[slots[t], g, d] = narrow(k[t, g, d], k_cache)
                v_cache[slots[t], g, d] = narrow(v[t, g, d], v_cache)
    return -1


def cpu(k, v, k_cache, v_cache, slots):
    """Same contract as ``ref``; slots are bounds-checked (in the kernel, before any write)."""
    k = np.ascontiguousarray(k, np.float32)
    v = np.ascontiguousarray(v, np.float32)
    slots = np.ascontiguousarray(slots, np.int32)
    assert k.shape == v.shape and k.shape[1:] == k_cache.shape[1:] == v_cache.shape[1:]
    assert slots.shape == (k.shape[0],), (slots.shape, k.shape)
    bad = _write(k, v, k_cache, v_cache, slots)
    if bad >= 0:
        raise IndexError(f"kv_write: slot {int(slots[bad])} out of range [0, {k_cache.shape[0]})")


# --- gpu: cuda/kv_write.cu ---

ARGS = {  # launch order of each entry point; tests/kernels/test_signatures.py checks it
    "kv_write_bf16": ("k:f32*", "v:f32*", "k_cache:u16*", "v_cache:u16*", "slots:i32*",
                      "T:i32", "GD:i32", "N:i32"),
    "kv_write_f32": ("k:f32*", "v:f32*", "k_cache:f32*", "v_cache:f32*", "slots:i32*",
                     "T:i32", "GD:i32", "N:i32"),
}


def gpu(k, v, k_cache, v_cache, slots):
    """Same contract as ``ref`` on CuPy arrays (the caches are the outputs). Slots are not
    bounds-checked on the host (that would synchronise); the kernel skips a slot outside [0, N)."""
    from freetoken.kernels import _cuda
    T, G, D = k.shape
    N = k_cache.shape[0]
    assert v.shape == k.shape and slots.shape == (T,), (k.shape, v.shape, slots.shape)
    assert k_cache.shape == v_cache.shape == (N, G, D), (k_cache.shape, v_cache.shape)
    assert k_cache.dtype == v_cache.dtype, (k_cache.dtype, v_cache.dtype)
    entry = f"kv_write_{_cuda.dtype_tag(k_cache)}"
    args = _cuda.bind(ARGS[entry], k=k, v=v, k_cache=k_cache, v_cache=v_cache, slots=slots,
                      T=T, GD=G * D, N=N)
    _cuda.launch(_cuda.kernel("kv_write", entry), (T,), (_cuda.threads(G * D, 256),), args)
