"""bench/lru_replay.py policies on small traces: Belady is a floor, the baselines are consistent."""
import importlib.util
from pathlib import Path

import pytest

from freetoken.moe.trace import synthetic_trace

_PATH = Path(__file__).resolve().parents[2] / "bench" / "lru_replay.py"


@pytest.fixture(scope="module")
def replay():
    spec = importlib.util.spec_from_file_location("lru_replay", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("rho", [0.0, 0.6])
def test_belady_is_a_floor(replay, rho):
    trace = synthetic_trace(3, 12, 3, 120, rho=rho, batch=2, seed=5)
    rows = replay.replay(trace, [10, 25, 50, 75, 100], warmup=0.25, phis=[0.3], min_fill=True)
    for r in rows:
        lrus = [r[k] for k in ("global-lru", "per-layer-lru") if r[k] is not None]
        assert all(r["belady"] <= v + 1e-12 for v in lrus), r
        others = [v for k, v in r.items() if k not in ("capacity_pct", "slots") and v is not None]
        assert all(r["belady-bypass"] <= v + 1e-12 for v in others), r
    assert rows[-1]["static"] == rows[-1]["belady"] == rows[-1]["belady-bypass"] == 0.0


def test_per_layer_with_one_layer_is_the_global_cache(replay):
    trace = synthetic_trace(1, 16, 4, 200, rho=0.4, seed=2)
    steps = list(trace.layer_steps())
    for S in (4, 7, 12):
        assert replay.per_layer_lru(steps, 1, 16, S, 50) == replay.global_lru(steps, 1, 16, S, 50)
    assert replay.per_layer_lru(steps, 1, 16, 3, 50) is None        # cannot hold one step


def test_main_writes_json_and_plot(replay, tmp_path):
    res = replay.main(["--rho", "0.5", "--layers", "2", "--experts", "8", "--top-k", "2",
                       "--steps", "30", "--capacities", "25", "100",
                       "--out", str(tmp_path / "r.json"), "--plot", str(tmp_path / "r.png")])
    assert (tmp_path / "r.json").stat().st_size > 0 and (tmp_path / "r.png").stat().st_size > 0
    assert [r["capacity_pct"] for r in res[0]["rows"]] == [25, 100]
