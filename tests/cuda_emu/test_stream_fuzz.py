"""The stream-order fuzz (cuda_emu/stream_fuzz.py): off, the device is lazy and an unsynchronised
read is always stale; on, work also runs early at seeded random moments, so what a missing wait
reads changes between seeds, while code with the right waits computes the same bytes under every
seed."""
import numpy as np
import pytest

from freetoken.cuda_emu import stream_fuzz


@pytest.fixture
def fuzz():
    """Sets the stream fuzz's seed for one test; the environment's again afterwards."""
    yield stream_fuzz.set_seed
    stream_fuzz._state.clear()


def _unsynchronised_reads(cp, seed: int, copies: int = 24) -> list[bool]:
    """For each of ``copies`` device-to-host copies queued and never waited for: whether the host already saw the copied bytes when it looked (before any sync)."""
    from freetoken.moe.device import CudaDevice
    stream_fuzz.set_seed(seed)
    dev, seen = CudaDevice(), []
    hosts = [dev.pinned((4,), np.float32) for _ in range(copies)]
    for i, host in enumerate(hosts):
        host[:] = -1
        x = cp.full(4, float(i), cp.float32)
        dev.d2h(host, x)
        seen.append(host[0] == i)
    cp.cuda.Device().synchronize()
    assert all(h[0] == i for i, h in enumerate(hosts))
    return seen


def test_off_every_unsynchronised_read_is_stale(cp, fuzz):
    assert not any(_unsynchronised_reads(cp, 0))


def test_on_some_work_runs_early_and_a_seed_replays_it(cp, fuzz):
    early = _unsynchronised_reads(cp, 11)
    assert any(early) and not all(early), early
    assert _unsynchronised_reads(cp, 11) == early
    assert any(_unsynchronised_reads(cp, s) != early for s in (12, 13, 14))


def _pipeline(cp, seed: int) -> np.ndarray:
    """Upload on the copy stream, compute on the current stream after the upload's event, download
    and wait: the waits a correct program has, with several rounds in flight."""
    from freetoken.moe.device import CudaDevice
    stream_fuzz.set_seed(seed)
    dev, results = CudaDevice(), []
    for round_ in range(6):
        src = dev.pinned((8,), np.float32)
        src[:] = np.arange(8) + round_
        buf, uploaded, out = cp.zeros(8, cp.float32), dev.event(), dev.pinned((8,), np.float32)
        dev.record(uploaded)
        dev.wait(uploaded, on_copy=True)
        dev.h2d(buf, src)
        dev.record(uploaded, on_copy=True)
        dev.wait(uploaded)
        y = buf * 2 + 1
        done = dev.event()
        dev.d2h(out, y)
        dev.record(done)
        dev.synchronize(done)
        results.append(out.copy())
    cp.cuda.Device().synchronize()
    return np.stack(results)


def test_correct_waits_give_the_same_bytes_under_every_seed(cp, fuzz):
    want = _pipeline(cp, 0)
    np.testing.assert_array_equal(want, (np.arange(8) + np.arange(6)[:, None]) * 2 + 1)
    for seed in range(1, 6):
        np.testing.assert_array_equal(_pipeline(cp, seed), want)


def test_a_device_sync_drains_streams_in_a_seeded_order(fuzz):
    streams = list(range(10))
    stream_fuzz.set_seed(0)
    assert stream_fuzz.drain_order(streams) == streams
    stream_fuzz.set_seed(3)
    first = stream_fuzz.drain_order(streams)
    assert sorted(first) == streams and first != streams
