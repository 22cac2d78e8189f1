"""Bandwidth profile: writer and reader, phi, the auto backend's decisions and the fallbacks."""
import json
import os

import pytest

from freetoken.moe import profile as prof
from freetoken.moe.profile import (HYBRID_THRESHOLD, Profile, load_profile, phi,
                                   recommend, save_profile)

UUID = "GPU-0b5d3c2e-1111-2222-3333-444455556666"


def make(b_p=25.0, b_h=60.0, contended=None, uuid=UUID, fmt="bf16"):
    return Profile(gpu_uuid=uuid, gpu_name="NVIDIA H200", format=fmt, expert_bytes=9437184,
                   b_h_gbs=b_h, b_p_gbs=b_p, contended=contended, recommended="hybrid",
                   reason="test", timestamp="2026-12-01T10:00:00", host="box",
                   cpu={"model": "x", "physical_cores": 16, "threads": 16})


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("FREETOKEN_HOME", str(tmp_path))
    return tmp_path


def test_round_trip_under_freetoken_home(home):
    p = make(contended={"pcie_gbs": 20.0, "cpu_gbs": 45.0})
    path = save_profile(p)
    assert path == home / "bench_bw.json"
    data = json.loads(path.read_text())
    assert data["version"] == prof.VERSION
    entry = data["profiles"][UUID]["bf16"]
    assert entry["gpu"] == {"uuid": UUID, "name": "NVIDIA H200"} and entry["b_p_gbs"] == 25.0
    assert load_profile(UUID, "bf16") == p


def test_entries_of_other_gpus_and_formats_are_kept(home):
    save_profile(make())
    save_profile(make(uuid="GPU-other", b_p=10.0))
    save_profile(make(fmt="f32", b_h=30.0))
    save_profile(make(b_p=26.0))                    # replaces only its own entry
    assert load_profile(UUID, "bf16").b_p_gbs == 26.0
    assert load_profile(UUID, "f32").b_h_gbs == 30.0
    assert load_profile("GPU-other", "bf16").b_p_gbs == 10.0


def test_write_is_atomic(home, monkeypatch):
    save_profile(make())
    before = (home / "bench_bw.json").read_text()

    def broken_dump(data, f, **kw):
        f.write('{"version": 1, "prof')          # a crash halfway through writing
        raise KeyboardInterrupt

    monkeypatch.setattr(prof.json, "dump", broken_dump)
    with pytest.raises(KeyboardInterrupt):
        save_profile(make(b_p=99.0))
    assert (home / "bench_bw.json").read_text() == before
    assert [p.name for p in home.iterdir()] == ["bench_bw.json"]   # no temporary file left


def test_other_gpu_is_ignored_with_a_warning(home):
    save_profile(make(uuid="GPU-somewhere-else"))
    logs = []
    assert load_profile(UUID, "bf16", log=logs.append) is None
    assert len(logs) == 1 and logs[0].startswith("WARN") and "GPU-somewhere-else" in logs[0]
    logs.clear()
    assert load_profile("GPU-somewhere-else", "fp8_block", log=logs.append) is None
    assert logs and "'fp8_block'" in logs[0]


def test_missing_file_is_silent(home):
    logs = []
    assert load_profile(UUID, "bf16", log=logs.append) is None and logs == []


@pytest.mark.parametrize("text", ["{not json", "[]", '{"version": 99, "profiles": {}}',
                                  '{"version": 1, "profiles": {"%s": {"bf16": {"gpu": {}}}}}' % UUID])
def test_corrupt_or_foreign_file_warns_not_crashes(home, text):
    (home / "bench_bw.json").write_text(text)
    logs = []
    assert load_profile(UUID, "bf16", log=logs.append) is None
    assert len(logs) == 1 and logs[0].startswith("WARN")
    save_profile(make(), log=logs.append)           # and the writer replaces it
    assert load_profile(UUID, "bf16") == make()


def test_phi_prefers_the_contended_pair():
    assert phi(make(b_p=25.0, b_h=60.0, contended={"pcie_gbs": 20.0, "cpu_gbs": 30.0})) == pytest.approx(0.4)
    assert phi(make(b_p=25.0, b_h=60.0)) == pytest.approx(25 / 60)
    assert phi(make(b_p=25.0, b_h=60.0, contended={"pcie_gbs": 0.0, "cpu_gbs": 30.0})) == pytest.approx(25 / 60)
    assert phi(make(b_p=None, b_h=60.0)) is None and phi(None) is None


@pytest.mark.parametrize("b_p,b_h,want", [
    (25.0, 60.0, "hybrid"),             # 2.4x
    (52.7, 77.3, "offload"),            # reference machine #1 (docs/design.md): 1.47x
    (11.8, 47.5, "hybrid"),             # 4x
    (30.0, 60.0, "offload"),            # exactly the threshold: not more than 2x
    (30.0, 60.0001, "hybrid"),          # just above it
])
def test_recommend(b_p, b_h, want):
    choice, reason = recommend(make(b_p=b_p, b_h=b_h), fits=False)
    assert choice == want
    assert f"{b_h:.1f} GB/s" in reason and f"{b_p:.1f} GB/s" in reason and f"{HYBRID_THRESHOLD:g} x" in reason


def test_recommend_fused_and_fallbacks():
    assert recommend(make(), fits=True)[0] == "fused"
    assert recommend(None, fits=True)[0] == "fused"
    choice, reason = recommend(None, fits=False)
    assert choice == "offload" and "bench bw" in reason
    assert recommend(make(b_p=None), fits=False)[0] == "offload"


def test_profile_path_default(monkeypatch):
    monkeypatch.delenv("FREETOKEN_HOME", raising=False)
    assert str(prof.profile_path()).endswith(os.path.join(".cache", "freetoken", "bench_bw.json"))
