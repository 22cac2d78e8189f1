"""bench/compare_llamacpp.py without llama.cpp: arguments, prompts of exact length, the round
order, the child timing, the converter shim, the session-file reader, and the table and JSON from
fake measurements. The real run against a llama.cpp build is ``slow``."""
import contextlib
import importlib.util
import json
import random
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from freetoken.models.demo import synth_tokenizer_dir

_BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture(scope="module")
def cmp():
    spec = importlib.util.spec_from_file_location("compare_llamacpp", _BENCH / "compare_llamacpp.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)      # puts bench/ on sys.path for its helper modules
    return mod


def test_arguments(cmp):
    a = cmp.parse_args([])
    assert a.synth == "medium" and a.model is None and a.threads == 2 and a.rounds == 3
    assert a.contexts == [64, 2048, 4096] and a.prefill == [512, 4096]
    assert a.out.endswith("bench/results/compare_llamacpp.json")
    b = cmp.parse_args(["--synth", "qwen3-30b-a3b,layers=12", "--contexts", "16,32", "--prefill", "8"])
    assert b.synth == "qwen3-30b-a3b,layers=12" and b.contexts == [16, 32] and b.prefill == [8]
    with pytest.raises(SystemExit):
        cmp.parse_args(["--model", "/x", "--synth", "tiny"])


def test_prompts_are_exactly_n_tokens(cmp):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(synth_tokenizer_dir() / "tokenizer.json"))
    words = cmp.prompt_words(synth_tokenizer_dir())
    rng = random.Random(3)
    for n in (1, 32, 777):
        a, b = cmp.make_prompt(words, n, rng), cmp.make_prompt(words, n, rng)
        assert len(tok.encode(a).ids) == n and a != b


class _Fake:
    repack = True

    def __init__(self, name, calls):
        self.name, self.calls = name, calls

    def startup(self, text, tokens):
        self.calls.append((self.name, "startup", text))
        return {"first_byte_s": 7.0 if self.name == "freetoken" else 0.5, "max_rss_bytes": int(5e9)}

    def decode(self, text, tokens, n):
        self.calls.append((self.name, f"decode@{tokens}", text))
        return {"tok_s": 90.0 if self.name == "freetoken" else 100.0}

    def prefill(self, text, tokens):
        self.calls.append((self.name, f"prefill@{tokens}", text))
        return {"tok_s": 250.0 if self.name == "freetoken" else 500.0}

    def first_prefill(self, text, tokens):
        self.calls.append((self.name, f"first-prefill@{tokens}", text))
        return {"tok_s": 200.0 if self.name == "freetoken" else 450.0}


def test_rounds_interleave_and_share_prompts(cmp, monkeypatch):
    calls, hogged = [], []

    @contextlib.contextmanager
    def fake_busy_core():
        hogged.append(len(calls))
        yield

    monkeypatch.setattr(cmp, "busy_core", fake_busy_core)
    engines = [_Fake("freetoken", calls), _Fake("llama.cpp", calls)]
    args = cmp.parse_args(["--contexts", "64", "--prefill", "512", "--hog-contexts", "32"])
    samples = cmp.run_rounds(engines, cmp.plan(args), 2, [" a", " b"], random.Random(0))
    assert [c[0] for c in calls[:2]] == ["freetoken", "llama.cpp"]
    assert [c[0] for c in calls[10:12]] == ["llama.cpp", "freetoken"]    # round 2 swaps
    assert all(calls[i][2] == calls[i + 1][2] for i in range(0, len(calls), 2))
    assert calls[0][2] != calls[10][2]                                    # fresh prompts per round
    assert set(samples) == {"startup", "decode@64", "prefill@512", "first-prefill@512", "decode@32+hog"}
    assert len(samples["decode@64"]["llama.cpp"]) == 2 and calls[6][1] == "first-prefill@512"
    assert hogged == [8, 9, 18, 19] and calls[8][1] == "decode@32"        # only the hog runs, each


def test_busy_core_runs_a_spinning_process_only_inside(cmp):
    import _child
    with _child.busy_core() as hog:
        assert hog.poll() is None
    assert hog.poll() is not None


def test_table_and_ratios(cmp):
    samples = {"decode@64": {"freetoken": [{"tok_s": 90.0}, {"tok_s": 96.0}, {"tok_s": 93.0}],
                             "llama.cpp": [{"tok_s": 100.0}, {"tok_s": 104.0}, {"tok_s": 102.0}]},
               "prefill@512": {"freetoken": [{"tok_s": 250.0}], "llama.cpp": [{"tok_s": None, "note": "x"}]},
               "startup": {"freetoken": [{"first_byte_s": 7.0, "max_rss_bytes": 5_000_000_000}],
                           "llama.cpp": [{"first_byte_s": 0.5, "max_rss_bytes": 2_500_000_000}]}}
    rows = {r["label"]: r for r in cmp.report.summarize(samples)}
    decode = rows["decode tok/s, 64 tokens of context"]
    assert decode["freetoken"]["median"] == 93.0 and decode["ratio"] == pytest.approx(93 / 102)
    assert rows["prefill tok/s, 512-token prompt"]["ratio"] is None
    assert rows["peak RSS of that run, GB"]["ratio"] == pytest.approx(2.0)
    text = cmp.report.table(list(rows.values()), 2, 3)
    assert decode["round_ratios"]["median"] == pytest.approx(93 / 102) and decode["round_ratios"]["n"] == 3
    assert decode["round_ratios"]["min"] == pytest.approx(0.9) and decode["round_ratios"]["max"] == pytest.approx(96 / 104)
    assert rows["prefill tok/s, 512-token prompt"]["round_ratios"] is None      # llama.cpp measured nothing
    assert "| decode tok/s, 64 tokens of context | 93.0 [90.0-96.0] | 102.0 [100.0-104.0] | 0.91 | 0.91 [0.90-0.92] |" in text
    assert "| peak RSS of that run, GB | 5.00 | 2.50 | 2.00 | 2.00 |" in text and ">= 1 FreeToken better" in text
    check = {"tokens": 16, "identical_prefix": 16, "prompt_ids_equal": True, "prompt_ids": [1] * 32}
    assert cmp.report.check_line(check).startswith("greedy check: same tokens; the first 16 of 16")


def test_main_writes_json_from_fake_engines(cmp, tmp_path, monkeypatch):
    calls = []
    ft, lc = _Fake("freetoken", calls), _Fake("llama.cpp", calls)
    ft.env, lc.record = {"NUMBA_NUM_THREADS": "2", "HOME": "x"}, {"build_commit": "abc"}
    lc.lc = type("LC", (), {"info": {"commit": "abc"}, "bench": "b", "completion": "c"})()
    ft.command = lambda text, n: ["python", "-m", "freetoken", "generate", "--prompt", text]
    lc.gguf, lc.threads, lc.max_len = tmp_path / "m.gguf", 2, 4200
    for e in (ft, lc):
        e.greedy_ids = lambda text, n: ([5] * 32, [7] * n)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"x")
    monkeypatch.setattr(cmp, "setup", lambda args: ([ft, lc], synth_tokenizer_dir(), gguf, 4200))
    out = tmp_path / "r.json"
    assert cmp.main(["--rounds", "1", "--contexts", "64", "--prefill", "512", "--hog-contexts", "",
                     "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["machine"]["cpu"]["model"] and data["llama_cpp"]["commit"] == "abc"
    assert data["llama_cpp"]["repack"] is True
    assert data["env"] == {"NUMBA_NUM_THREADS": "2"} and data["greedy_check"]["identical_prefix"] == 64
    assert data["commands"]["llama-bench decode"][:3] == ["b", "-m", str(tmp_path / "m.gguf")]
    assert data["flags"]["threads"] == 2 and {r["measure"] for r in data["rows"]} == {
        "startup", "decode@64", "prefill@512", "first-prefill@512"}


def test_child_timing(cmp):
    from _child import run_child
    code = "import time, sys; time.sleep(0.3); print('x', flush=True); b = bytearray(200 << 20); b[::4096] = b'y' * len(b[::4096])"
    run = run_child([sys.executable, "-c", code])
    assert run.returncode == 0 and run.stdout == "x\n"
    assert 0.3 <= run.first_byte_s <= run.wall_s and run.max_rss_bytes > 200 << 20
    failed = run_child([sys.executable, "-c", "import sys; sys.exit('nope')"])
    with pytest.raises(RuntimeError, match="nope"):
        failed.check("child")


def test_converter_shim_falls_back_only_for_unknown_hashes(cmp, tmp_path):
    import _llamacpp
    fake = tmp_path / "convert_hf_to_gguf.py"
    fake.write_text("import sys\nclass TextModel:\n    def get_vocab_base_pre(self, tok):\n"
                    "        if tok == 'known':\n            return 'qwen2'\n        raise NotImplementedError\n"
                    "def main():\n    print(TextModel().get_vocab_base_pre(sys.argv[1]))\n")
    for tok, want in (("known", "qwen2"), ("ours", "gpt-2")):
        out = subprocess.run([sys.executable, "-c", _llamacpp._SHIM, str(fake), "gpt-2", tok],
                             capture_output=True, text=True, check=True).stdout
        assert out.strip() == want


def test_session_file_reader(cmp, tmp_path):
    import _llamacpp
    path = tmp_path / "s.bin"
    path.write_bytes(struct.pack("<III5i", _llamacpp.SESSION_MAGIC, 10, 5, 1, 2, 3, 4, 5) + b"state")
    assert _llamacpp.session_tokens(path) == [1, 2, 3, 4, 5]
    path.write_bytes(b"\0" * 16)
    with pytest.raises(ValueError, match="session"):
        _llamacpp.session_tokens(path)


@pytest.mark.slow
def test_real_run_on_tiny(cmp, tmp_path):
    """Both engines end to end on synth:tiny against the cached llama.cpp build."""
    import _llamacpp
    from freetoken.env import home
    built = [m.parent for m in (home() / "llama.cpp").glob("*/build.json")]
    if not any(_llamacpp._found(b / "build", {}, _llamacpp._vendored(b)) for b in built):
        pytest.skip(f"no llama.cpp build under {home() / 'llama.cpp'} (run the bench once to build it)")
    if subprocess.run([sys.executable, "-c", "import torch"], capture_output=True).returncode:
        pytest.skip("llama.cpp's converter needs torch in this python")
    out = tmp_path / "r.json"
    assert cmp.main(["--synth", "tiny", "--rounds", "1", "--contexts", "16", "--decode", "8",
                     "--prefill", "32", "--check-tokens", "16", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert all(r["ratio"] for r in data["rows"]) and data["greedy_check"]["prompt_ids_equal"]


def test_quant_runs_both_engines_on_one_quantized_file(cmp, tmp_path, monkeypatch):
    import _llamacpp
    tool = tmp_path / "llama-quantize"
    tool.write_text("#!/bin/sh\necho \"$3\" > \"$2\"\n")          # src out TYPE threads -> out holds TYPE
    bench = tmp_path / "llama-bench"
    bench.write_text("#!/bin/sh\necho '-d, --n-depth'\n")
    for exe in (tool, bench):
        exe.chmod(0o755)
    lc = _llamacpp.LlamaCpp(bench, tmp_path / "c", tmp_path / "conv.py", {}, tool)
    src = tmp_path / "model-bf16.gguf"
    src.write_bytes(b"x")
    monkeypatch.setattr(cmp.llamacpp, "locate", lambda *a: lc)
    monkeypatch.setattr(cmp.llamacpp, "convert", lambda *a: src)
    monkeypatch.setattr(cmp, "prepare_model", lambda args, cache: (tmp_path / "hf", tmp_path))
    engines, _, gguf, _ = cmp.setup(cmp.parse_args(["--quant", "Q4_K_M"]))
    assert gguf == tmp_path / "model-q4_k_m.gguf" and gguf.read_text().strip() == "Q4_K_M"
    assert engines[0].hf == gguf and engines[1].gguf == gguf       # FreeToken reads the same file
    tool.unlink()
    assert _llamacpp.quantize(lc, src, "Q4_K_M", 2) == gguf        # made once: not made again
    with pytest.raises(SystemExit, match="llama-quantize"):
        _llamacpp.quantize(_llamacpp.LlamaCpp(lc.bench, lc.completion, lc.converter, {}), src, "Q8_0", 2)
    tool.write_text("#!/bin/sh\necho 'invalid type' >&2\ntouch \"$2\"\nexit 1\n")
    tool.chmod(0o755)
    with pytest.raises(SystemExit, match="llama-quantize Q9 failed.*invalid type"):
        _llamacpp.quantize(lc, src, "Q9", 2)
    assert not list(tmp_path.glob("*.partial"))
    engines, _, _, _ = cmp.setup(cmp.parse_args([]))
    assert engines[0].hf == tmp_path / "hf" and engines[1].gguf == src


def test_llama_cpp_killed_by_a_signal_runs_again_with_repacking_off(cmp, monkeypatch, tmp_path, capsys):
    """Its repacked (AMX) kernels segfaulted on a Q4_K_M file on one Xeon: the start-up run is
    retried once without repacking, and every later command says so too."""
    import _engines
    from _child import ChildRun
    cmds = []

    def fake_run(cmd, env=None, timeout=None, cwd=None):
        cmds.append([str(c) for c in cmd])
        code = -11 if len(cmds) == 1 else 0
        return ChildRun(cmd, code, 1.0, 0.5, 1 << 30, "x 1\n", "")
    monkeypatch.setattr(_engines, "run_child", fake_run)
    monkeypatch.setattr(_engines, "read_through", lambda files: None)
    monkeypatch.setattr(_engines.llamacpp, "supports_depth", lambda lc: True)
    lc = _engines.llamacpp.LlamaCpp(tmp_path / "llama-bench", tmp_path / "llama-completion", tmp_path / "c.py", {})
    runs = _engines.LlamaCppRuns(lc, tmp_path / "m.gguf", 2, 4096, 60)
    got = runs.startup("hello", 1)
    assert got["repack"] is False and runs.repack is False
    assert "--no-repack" not in cmds[0] and cmds[1][-1] == "--no-repack"
    assert "signal 11" in capsys.readouterr().out
    monkeypatch.setattr(_engines.llamacpp, "bench_tok_s", lambda out: 5.0)
    monkeypatch.setattr(_engines.llamacpp, "bench_record", lambda out: {})
    assert runs._bench(8, 0)["tok_s"] == 5.0 and cmds[-1][-2:] == ["--repack", "0"]


def test_freetoken_runs_measure_through_their_child_processes(cmp):
    """FreeToken's side for real on synth:tiny: the warm-prefill child (a warm-up prompt of the
    same length, then the timed one), a fresh process's first prefill, and decode, each a
    positive rate from its own process."""
    import _engines
    runs = _engines.FreeTokenRuns(Path("synth:tiny"), threads=1, max_len=256, timeout=600)
    text = cmp.make_prompt(cmp.prompt_words(synth_tokenizer_dir()), 32, random.Random(5))
    warm, first, decode = runs.prefill(text, 32), runs.first_prefill(text, 32), runs.decode(text, 32, 8)
    assert warm["tok_s"] > 0 and first["tok_s"] > 0 and decode["tok_s"] > 0
    assert min(warm["max_rss_bytes"], first["max_rss_bytes"]) > 0
    with pytest.raises(RuntimeError, match="not 31"):
        runs.prefill(text, 31)                       # the prompt's length is checked, not assumed
