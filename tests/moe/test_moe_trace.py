"""Routing traces: recorder/reader round trip and the synthetic generator's stated locality."""
import numpy as np
import pytest

from freetoken.moe.trace import (RoutingRecorder, load_trace, shared_consecutive, synthetic_trace,
                                 zipf_popularity)


def test_recorder_round_trip(tmp_path, rng):
    rec = RoutingRecorder(num_layers=2, num_experts=16, top_k=3, model="toy")
    calls = []
    for step in range(4):
        for j in range(2):
            ids = np.stack([rng.choice(16, 3, replace=False) for _ in range(step % 2 + 1)]).astype(np.int32)
            rec.record(j, ids)
            calls.append((j, ids))
    rec.save(tmp_path / "t.npz")
    tr = load_trace(tmp_path / "t.npz")
    assert (tr.num_layers, tr.num_experts, tr.top_k, tr.meta["model"]) == (2, 16, 3, "toy")
    assert tr.ids.dtype == np.int16 and tr.layer.dtype == np.int16 and tr.step.dtype == np.int32
    got = list(tr.layer_steps())
    assert len(got) == len(calls) == tr.num_layer_steps()
    for (j, ids), (gj, gids) in zip(calls, got):
        assert j == gj and gids.dtype == np.int32 and np.array_equal(ids, gids)


def test_version_is_checked(tmp_path):
    tr = synthetic_trace(1, 4, 2, 3, rho=0.5)
    bad = type(tr)(tr.ids, tr.layer, tr.step, {**tr.meta, "version": 99})
    bad.save(tmp_path / "bad.npz")
    with pytest.raises(ValueError, match="version 99"):
        load_trace(tmp_path / "bad.npz")


def test_synthetic_is_valid_and_deterministic():
    a = synthetic_trace(3, 10, 4, 50, rho=0.4, batch=2, seed=3)
    b = synthetic_trace(3, 10, 4, 50, rho=0.4, batch=2, seed=3)
    assert np.array_equal(a.ids, b.ids) and a.num_layer_steps() == 150
    assert a.ids.min() >= 0 and a.ids.max() < 10
    assert all(len(set(row)) == 4 for row in a.ids.tolist())       # top-k ids are distinct
    assert all(ids.shape == (2, 4) for _, ids in a.layer_steps())


def test_locality_follows_rho():
    E, k = 16, 4
    frozen = synthetic_trace(2, E, k, 40, rho=1.0, seed=1)
    assert np.allclose(shared_consecutive(frozen), k)
    shared = [shared_consecutive(synthetic_trace(2, E, k, 400, rho=r, zipf_s=0.0, seed=1)).mean()
              for r in (0.0, 0.5, 0.9)]
    assert abs(shared[0] - k * k / E) < 0.2                          # uniform, independent
    assert shared[0] < shared[1] < shared[2] < k


def test_zipf_popularity(rng):
    p = zipf_popularity(8, 1.0, rng)
    assert np.isclose(p.sum(), 1.0)
    assert np.allclose(np.sort(p)[::-1] / p.max(), 1.0 / np.arange(1, 9))


def test_recording_moe_records_decode_only(tmp_path, rng):
    from moe_helpers import build, np_experts, random_banks, random_routing

    from freetoken.moe.trace import RecordingMoE
    banks = random_banks(rng, 3, 8, 16, 8)
    moe = RecordingMoE(build("fused", banks), RoutingRecorder(3, 8, 2, "toy"))
    routes = []
    for step in range(4):
        for j in range(3):
            ids, w = random_routing(rng, 2, 8, 2)
            x = rng.standard_normal((2, 16), np.float32)
            out = moe.forward(j, x, ids, w, prefill=step == 0)
            np.testing.assert_allclose(out, np_experts(x, ids, w, *banks[j]), rtol=1e-6)
            routes += [] if step == 0 else [(j, ids)]
    assert moe.stats()["backend"] == "fused"                       # delegated
    moe.recorder.save(tmp_path / "t.npz")
    got = list(load_trace(tmp_path / "t.npz").layer_steps())
    assert [j for j, _ in got] == [j for j, _ in routes]
    assert all(np.array_equal(a, b) for (_, a), (_, b) in zip(got, routes))
