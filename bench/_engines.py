"""The two engines of bench/compare_llamacpp.py, each measurement one process: FreeToken through
``python -m freetoken generate`` (its summary line has the prefill and decode tok/s), llama.cpp
through llama-bench and llama-completion (bench/_llamacpp.py builds the command lines)."""
from __future__ import annotations

import json
import re
import sys
import tempfile
from pathlib import Path

import _llamacpp as llamacpp
from _child import child_env, read_through, run_child

STARTUP_DECODE = 16       # tokens the start-up runs generate (a few, so some decode to text)
_SUMMARY = re.compile(r"prompt tokens (\d+) \| generated tokens (\d+) \| prefill ([\d.]+) tok/s \| "
                      r"decode ([\d.]+) tok/s")
# FreeToken's greedy ids through the public API (generate prints text only)
_FT_IDS = ("import json, sys; from freetoken import LLM, SamplingParams; a = json.loads(sys.argv[1]); "
           "llm = LLM(a['model'], backend='cpu', max_running_requests=1, moe_cpu_threads=a['threads']); "
           "o = llm.generate(a['text'], SamplingParams(max_tokens=a['n'], temperature=0.0, ignore_eos=True))[0]; "
           "print(json.dumps({'prompt': o.prompt_token_ids, 'out': o.token_ids}))")
# FreeToken's prefill as llama-bench times its own: after a warm-up prompt of the same length in the
# same process (the first prompt of a process pays for fresh scratch pages and first calls)
_FT_WARM_PREFILL = (
    "import json, sys; from freetoken import LLM, SamplingParams; a = json.loads(sys.argv[1]); "
    "llm = LLM(a['model'], backend='cpu', max_running_requests=1, moe_cpu_threads=a['threads'], "
    "max_model_len=a['max_len']); p = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True); "
    "o = [llm.generate(t, p)[0] for t in (a['warm'], a['text'])]; "
    "print(json.dumps({'tokens': [len(x.prompt_token_ids) for x in o], 'tok_s': o[1].metrics['prefill_tok_s']}))")


def _startup_numbers(run) -> dict:
    """The start-up run's numbers, and its log's last lines (a slow start says why there: compiles)."""
    return {"first_byte_s": run.first_byte_s, "max_rss_bytes": run.max_rss_bytes, "wall_s": run.wall_s,
            "stderr_tail": run.stderr.strip().splitlines()[-12:]}


class FreeTokenRuns:
    name = "freetoken"

    def __init__(self, hf: Path, threads: int, max_len: int, timeout: float):
        """hf: the model FreeToken reads, a HF directory or a GGUF file."""
        self.hf, self.threads, self.max_len, self.timeout = hf, threads, max_len, timeout
        self.env = child_env(threads)

    def command(self, text: str, n: int) -> list:
        return [sys.executable, "-m", "freetoken", "generate", "--model", self.hf, "--backend", "cpu",
                "--max-running-requests", 1, "--moe-cpu-threads", self.threads, "--max-model-len",
                self.max_len, "--temperature", 0, "--ignore-eos", "--prompt", text, "--max-tokens", n]

    def _run(self, text: str, n: int, tokens: int):
        run = run_child(self.command(text, n), self.env, self.timeout).check("freetoken generate")
        m = _SUMMARY.search(run.stderr)
        if not m or int(m.group(1)) != tokens:
            raise RuntimeError(f"freetoken generate: no summary for a {tokens}-token prompt:\n{run.stderr[-800:]}")
        return run, float(m.group(3)), float(m.group(4))

    def startup(self, text: str, tokens: int) -> dict:
        files = [self.hf] if self.hf.is_file() else sorted(self.hf.glob("*.safetensors"))
        read_through(files)                                     # "warm page cache" made true
        return _startup_numbers(self._run(text, STARTUP_DECODE, tokens)[0])

    def decode(self, text: str, tokens: int, n: int) -> dict:
        run, _, decode = self._run(text, n, tokens)
        return {"tok_s": decode, "max_rss_bytes": run.max_rss_bytes}

    def prefill(self, text: str, tokens: int) -> dict:
        """After a warm-up prompt of as many tokens (text's words reversed: no prefix-cache hit)."""
        warm = "".join(" " + w for w in reversed(text.split(" ")[1:]))
        arg = json.dumps({"model": str(self.hf), "threads": self.threads, "max_len": self.max_len,
                          "warm": warm, "text": text})
        run = run_child([sys.executable, "-c", _FT_WARM_PREFILL, arg], self.env, self.timeout).check("freetoken prefill")
        got = json.loads(run.stdout.strip().splitlines()[-1])
        if got["tokens"] != [tokens, tokens]:
            raise RuntimeError(f"freetoken prefill: prompts of {got['tokens']} tokens, not {tokens}")
        return {"tok_s": got["tok_s"], "max_rss_bytes": run.max_rss_bytes}

    def first_prefill(self, text: str, tokens: int) -> dict:
        """The first prompt of a fresh ``generate`` process."""
        run, prefill, _ = self._run(text, 1, tokens)
        return {"tok_s": prefill, "max_rss_bytes": run.max_rss_bytes}

    def greedy_ids(self, text: str, n: int) -> tuple[list, list]:
        arg = json.dumps({"model": str(self.hf), "threads": self.threads, "text": text, "n": n})
        run = run_child([sys.executable, "-c", _FT_IDS, arg], self.env, self.timeout).check("freetoken ids")
        ids = json.loads(run.stdout.strip().splitlines()[-1])
        return ids["prompt"], ids["out"]


class LlamaCppRuns:
    name = "llama.cpp"

    def __init__(self, lc, gguf: Path, threads: int, max_len: int, timeout: float):
        self.lc, self.gguf, self.threads, self.max_len, self.timeout = lc, gguf, threads, max_len, timeout
        self.env = child_env(threads)
        self.depth = llamacpp.supports_depth(lc)
        self.record = None        # llama-bench's description of itself, from the first run
        self.repack = True        # llama.cpp's own default: weights repacked for its AMX/AVX kernels

    def startup(self, text: str, tokens: int) -> dict:
        read_through([self.gguf])
        run = run_child(self._completion(text, STARTUP_DECODE), self.env, self.timeout)
        if run.returncode < 0 and not run.timed_out:
            # killed by a signal at its default settings: on the Xeon VM its AMX kernels segfault on
            # a Q4_K_M file (ggml_backend_amx_mul_mat); without repacking it runs its AVX-512 ones
            print(f"# llama.cpp died of signal {-run.returncode} with its weights repacked (its AMX / "
                  "repacked CPU kernels); running it with repacking off from here on", flush=True)
            self.repack = False
            run = run_child(self._completion(text, STARTUP_DECODE), self.env, self.timeout)
        return {**_startup_numbers(run.check("llama-completion")), "repack": self.repack}

    def _completion(self, text: str, n: int, session: Path | None = None) -> list:
        cmd = llamacpp.completion_cmd(self.lc, self.gguf, self.threads, text, n, self.max_len, session)
        return cmd + ([] if self.repack else ["--no-repack"])

    def _bench(self, prompt: int, gen: int, depth: int = 0, warm_up: bool = True) -> dict:
        cmd = llamacpp.bench_cmd(self.lc, self.gguf, self.threads, prompt, gen, depth)
        cmd += ([] if self.repack else ["--repack", 0]) + ([] if warm_up else ["--no-warmup"])
        run = run_child(cmd, self.env, self.timeout).check("llama-bench")
        self.record = self.record or llamacpp.bench_record(run.stdout)
        return {"tok_s": llamacpp.bench_tok_s(run.stdout), "max_rss_bytes": run.max_rss_bytes}

    def decode(self, text: str, tokens: int, n: int) -> dict:
        return self._bench(0, n, tokens) if self.depth else {"tok_s": None, "note": "llama-bench has no -d"}

    def prefill(self, text: str, tokens: int) -> dict:
        return self._bench(tokens, 0)

    def first_prefill(self, text: str, tokens: int) -> dict:
        return self._bench(tokens, 0, warm_up=False)

    def greedy_ids(self, text: str, n: int) -> tuple[list, list]:
        with tempfile.TemporaryDirectory() as tmp:
            session = Path(tmp) / "session.bin"
            run_child(self._completion(text, n, session), self.env, self.timeout).check("llama-completion --prompt-cache")
            ids = llamacpp.session_tokens(session)
        return ids[:-n], ids[-n:]
