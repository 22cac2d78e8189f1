"""Pinning the host expert pool: in place for in-memory banks, a copy for memory-mapped ones, and
the WARN + pageable fallback when pinning fails (the real driver on a GPU-less machine, and a
fake CuPy that fails halfway)."""
import sys
import types

import numpy as np
import pytest
from moe_helpers import E, H, I, L, random_banks

from freetoken.moe.host_pool import HostPool, _owns_writable_memory, pin_host_pool


def test_pinning_without_a_gpu_warns_and_stays_pageable():
    banks = random_banks(np.random.default_rng(0), L, E, H, I)
    logs = []
    pool = pin_host_pool(banks, logs.append)
    assert not pool.pinned and pool.num_layers == L
    assert all(b.gate_up is gu and b.down is dn for b, (gu, dn) in zip(pool.banks, banks))
    assert len(logs) == 1 and logs[0].startswith("WARN pinning the host expert pool")
    assert "all-CPU fallback" in logs[0]
    with pytest.raises(RuntimeError, match="not pinned"):
        pool.device_views(0)
    pool.close()
    pool.close()                                   # idempotent


def test_only_plain_writable_memory_is_registered_in_place(tmp_path):
    a = np.zeros((4, 8), np.uint16)
    assert _owns_writable_memory(a) and _owns_writable_memory(a[1:])
    ro = a.copy()
    ro.flags.writeable = False
    assert not _owns_writable_memory(ro)
    path = tmp_path / "m.bin"
    np.zeros(32, np.uint16).tofile(path)
    assert not _owns_writable_memory(np.memmap(path, np.uint16, "r", shape=(4, 8)))
    assert not _owns_writable_memory(np.memmap(path, np.uint16, "r+", shape=(4, 8)))
    assert not _owns_writable_memory(np.zeros((8, 4), np.uint16).T)


class FakeCupy:
    """Just the CuPy calls pin_host_pool makes; `fail_after` registrations succeed."""

    def __init__(self, fail_after=10**9):
        self.registered, self.unregistered, self.allocated = [], [], 0
        fake = self

        class Runtime:
            cudaDevAttrCanUseHostPointerForRegisteredMem = 91

            @staticmethod
            def deviceGetAttribute(attr, dev):
                return 1

            @staticmethod
            def hostRegister(ptr, size, flags):
                if len(fake.registered) >= fail_after:
                    raise RuntimeError("cudaErrorHostMemoryAlreadyRegistered (fake)")
                assert flags == 3                    # portable | mapped: kernels read it
                fake.registered.append(ptr)

            @staticmethod
            def hostUnregister(ptr):
                fake.unregistered.append(ptr)

        def pinned_memory(size, flags):
            assert flags == 3
            fake.allocated += 1
            return bytearray(size)

        self.cuda = types.SimpleNamespace(runtime=Runtime, Device=lambda: types.SimpleNamespace(id=0),
                                          PinnedMemory=pinned_memory,
                                          PinnedMemoryPointer=lambda mem, off: mem)


def test_in_place_and_copied_banks(monkeypatch, tmp_path):
    fake = FakeCupy()
    monkeypatch.setitem(sys.modules, "cupy", fake)
    rng = np.random.default_rng(1)
    banks = random_banks(rng, 2, E, H, I)
    path = tmp_path / "down.bin"
    banks[1][1].tofile(path)
    mapped = np.memmap(path, np.uint16, "r", shape=banks[1][1].shape)
    banks[1] = (banks[1][0], mapped)
    logs = []
    pool = pin_host_pool(banks, logs.append)
    assert pool.pinned and logs[-1].startswith("host expert pool pinned: 2 layers")
    assert pool.banks[0].gate_up is banks[0][0] and len(fake.registered) == 3
    assert fake.allocated == 1 and pool.banks[1].down is not mapped
    np.testing.assert_array_equal(pool.banks[1].down, mapped)
    pool.close()
    assert sorted(fake.unregistered) == sorted(fake.registered) and not pool.pinned


def test_pools_over_the_same_arrays_share_one_registration(monkeypatch):
    """Two engines over one loaded model pin the same arrays: the driver refuses a second
    registration of a range, so the second pool reuses the first's, and the last close undoes it."""
    fake = FakeCupy()
    monkeypatch.setitem(sys.modules, "cupy", fake)
    banks = random_banks(np.random.default_rng(3), 2, E, H, I)
    first, second = pin_host_pool(banks), pin_host_pool(banks)
    assert first.pinned and second.pinned and len(fake.registered) == 4
    first.close()
    assert fake.unregistered == [] and second.pinned
    second.close()
    assert sorted(fake.unregistered) == sorted(fake.registered)
    third = pin_host_pool(banks)                   # registered afresh after the last close
    assert len(fake.registered) == 8
    third.close()


def test_failure_halfway_releases_what_was_pinned(monkeypatch):
    fake = FakeCupy(fail_after=3)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    banks = random_banks(np.random.default_rng(2), L, E, H, I)
    logs = []
    pool = pin_host_pool(banks, logs.append)
    assert not pool.pinned and isinstance(pool, HostPool)
    assert sorted(fake.unregistered) == sorted(fake.registered) and len(fake.registered) == 3
    assert logs[0].startswith("WARN") and "fake" in logs[0]


def test_pageable_pool_checks_banks():
    banks = random_banks(np.random.default_rng(3), 2, E, H, I)
    pool = HostPool.pageable(banks)
    assert pool.nbytes == sum(g.nbytes + d.nbytes for g, d in banks)
    assert pool.host(1)[0] is banks[1][0]
    with pytest.raises(ValueError, match="expert banks"):
        HostPool.pageable([banks[0], (banks[1][0][:, :4], banks[1][1])])
