"""`python -m freetoken bench bw` on the CPU-only path: B_H measured, B_P skipped and said so, the
profile written under FREETOKEN_HOME (or --out) and readable by the engine's reader."""
import json
from pathlib import Path

import pytest

from freetoken import backend
from freetoken.cli import main
from freetoken.commands.bench import expert_shape, synthetic_bank
from freetoken.models.hf_config import model_config_from_dict
from freetoken.models.synth import PRESETS
from freetoken.moe.profile import NO_GPU, load_profile


@pytest.fixture
def no_gpu(monkeypatch, tmp_path):
    """The CPU-only path even on a GPU machine; profiles land in a temporary FREETOKEN_HOME."""
    monkeypatch.setattr(backend, "cuda_unavailable_reason", lambda: "forced off by the test")
    monkeypatch.setenv("FREETOKEN_HOME", str(tmp_path))
    return tmp_path


def test_cpu_only_run_writes_a_b_h_profile(no_gpu, capsys):
    assert main(["bench", "bw", "--model", "synth:tiny", "--iters", "4", "--bank-mib", "1"]) == 0
    out = capsys.readouterr().out
    assert "no GPU (forced off by the test): measuring B_H only" in out
    assert "B_H" in out and "fill, pinned host" not in out and "hand-off" in out
    data = json.loads((no_gpu / "bench_bw.json").read_text())
    entry = data["profiles"][NO_GPU]["bf16"]
    assert entry["b_h_gbs"] > 0 and entry["b_p_gbs"] is None and entry["contended"] is None
    assert entry["expert_bytes"] == 3 * 32 * 64 * 2 and entry["recommended"] == "cpu"
    assert set(entry["handoff_us"]) == {"thread", "inline"}
    prof = load_profile(NO_GPU, "bf16")
    assert prof is not None and prof.b_h_gbs == entry["b_h_gbs"]


def test_out_file_and_demo_model_default(no_gpu, tmp_path, capsys):
    out = tmp_path / "sub" / "p.json"
    assert main(["bench", "bw", "--iters", "2", "--bank-mib", "1", "--out", str(out)]) == 0
    assert f"profile written to {out}" in capsys.readouterr().out
    assert json.loads(out.read_text())["profiles"][NO_GPU]["bf16"]["expert_bytes"] == 3 * 128 * 256 * 2
    assert not (no_gpu / "bench_bw.json").exists()


def test_expert_shape_and_synthetic_bank():
    shape = expert_shape("synth:qwen3-30b-a3b,layers=2")
    assert (shape["hidden"], shape["width"], shape["top_k"], shape["experts"]) == (2048, 768, 8, 256)
    tiny = expert_shape("synth:tiny")
    gu, dn = synthetic_bank(tiny, 1 << 20)
    assert gu.shape == (16, 64, 64) and dn.shape == (16, 64, 32) and gu.dtype == dn.dtype
    exponent = (gu >> 7) & 0xFF
    assert exponent.min() >= 119 and exponent.max() <= 122        # no denormals, no zeros
    assert synthetic_bank(tiny, 0)[0].shape[0] == 2 * tiny["top_k"]   # windows stay disjoint


def test_a_quantized_checkpoints_experts_are_measured_in_their_format():
    """gpt-oss as the hub ships it (a synth preset, the MXFP4 fixture directory) is mxfp4, the
    fixture's dense variants their dtype; block FP8 is fp8_b128 where its rows are whole blocks."""
    from freetoken.commands.bench import _stored_format
    from freetoken.models.hf_config import read_model_config
    fixtures = Path(__file__).parent / "fixtures" / "hf" / "gpt_oss"
    assert expert_shape("synth:gpt-oss-20b,layers=2")["format"] == "mxfp4"
    assert expert_shape(str(fixtures / "mxfp4"))["format"] == "mxfp4"
    assert expert_shape(str(fixtures / "fp32"))["format"] == "f32"
    assert expert_shape(str(fixtures / "bf16"))["format"] == "bf16"
    big = model_config_from_dict(PRESETS["qwen3-30b-a3b"].hf_config())
    assert _stored_format({"quant_method": "fp8"}, big) == "fp8_b128"
    assert _stored_format({"quant_method": "fp8"}, read_model_config(fixtures / "fp32")) is None   # 64-wide rows


@pytest.mark.gpu
def test_device_run_measures_the_fill_path_and_the_pair(tmp_path):
    """B_P through the fill kernel over the pinned pool, the contended pair and phi, on the
    device (a GPU, or the emulated one: then the numbers are the emulator's, and it says so)."""
    import json
    import subprocess
    import sys
    out = tmp_path / "bw.json"
    proc = subprocess.run([sys.executable, "-m", "freetoken", "bench", "bw", "--bank-mib", "16",
                           "--iters", "8", "--seconds", "0.5", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "B_P" in proc.stdout and "contended pair" in proc.stdout and "phi" in proc.stdout
    (gpu,) = json.loads(out.read_text())["profiles"].values()
    assert gpu["bf16"]["b_p_gbs"] > 0 and gpu["bf16"]["contended"]["pcie_gbs"] > 0


def test_a_quantized_format_has_its_own_entry(no_gpu, capsys):
    """--format q8_0: B_H of the CPU kernel reading blocks, filed under "q8_0" beside "bf16" (the
    engine loads the entry of its experts' format); a shape that is not whole blocks is refused."""
    for fmt in ("bf16", "q8_0"):
        assert main(["bench", "bw", "--model", "synth:tiny", "--format", fmt, "--iters", "4", "--bank-mib", "1"]) == 0
    assert "q8_0 experts of" in capsys.readouterr().out
    entries = json.loads((no_gpu / "bench_bw.json").read_text())["profiles"][NO_GPU]
    assert entries["q8_0"]["expert_bytes"] == 3 * 64 * 32 // 32 * 34 and entries["q8_0"]["b_h_gbs"] > 0
    assert entries["bf16"]["expert_bytes"] == 3 * 64 * 32 * 2
    assert load_profile(NO_GPU, "q8_0").format == "q8_0"
    gguf = Path(__file__).parent / "fixtures" / "gguf" / "qwen3moe_256-q4_k_m.gguf"
    assert expert_shape(str(gguf))["format"] == "q4_k"            # a GGUF: its experts' blocks
    with pytest.raises(SystemExit, match="whole blocks of 256"):
        main(["bench", "bw", "--model", "synth:tiny", "--format", "q4_k", "--iters", "2", "--bank-mib", "1"])


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,block_bytes", [("q8_0", 34), ("mxfp4", 17)])
def test_device_run_of_a_quantized_format(tmp_path, fmt, block_bytes):
    """B_P of quantized slots: the fill kernel's u8 copy moves the blocks as stored (mxfp4: gpt-oss's)."""
    out = tmp_path / "bw.json"
    assert main(["bench", "bw", "--model", "synth:tiny", "--format", fmt, "--bank-mib", "1", "--iters", "4",
                 "--seconds", "0.2", "--out", str(out)]) == 0
    (gpu,) = json.loads(out.read_text())["profiles"].values()
    assert gpu[fmt]["b_p_gbs"] > 0 and gpu[fmt]["expert_bytes"] == 3 * 64 * 32 // 32 * block_bytes
