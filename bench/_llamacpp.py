"""llama.cpp for bench/compare_llamacpp.py: find a build or build the source vendored in the
llama-cpp-python sdist (once, under FREETOKEN_HOME), convert a HF checkpoint with llama.cpp's own
convert_hf_to_gguf.py, and the llama-bench / llama-completion command lines and outputs."""
from __future__ import annotations

import json
import re
import shutil
import struct
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

SDIST = "llama_cpp_python"
TARGETS = ("llama-bench", "llama-completion", "llama-quantize")
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF",
               "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF",
               "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF")
CONVERT_DEPS = "torch transformers numpy pyyaml tqdm sentencepiece"   # what the converter imports
SESSION_MAGIC = 0x6767736E        # 'ggsn': llama.h LLAMA_SESSION_MAGIC (session files start with it)


@dataclass(frozen=True)
class LlamaCpp:
    bench: Path               # llama-bench
    completion: Path          # llama-completion (llama-cli before the two were split)
    converter: Path           # convert_hf_to_gguf.py of the same source
    info: dict                # where it came from: sdist version, commit, cmake flags
    quantizer: Path | None = None   # llama-quantize (--quant); builds before it was a target lack it


def locate(build_dir: str | None, cache: Path, jobs: int, log=print) -> LlamaCpp:
    """The llama.cpp of --llama-cpp DIR, else the one built from the sdist in `cache`."""
    if build_dir:
        root = Path(build_dir).expanduser().resolve()
        return _found(root, {"source": str(root)}) or _missing(root)
    built = sorted(cache.glob("*/build.json"), key=lambda p: p.stat().st_mtime)
    for meta in reversed(built):
        found = _found(meta.parent / "build", json.loads(meta.read_text()), _vendored(meta.parent))
        if found:
            return found
    return build_from_sdist(cache, jobs, log)


def _vendored(root: Path) -> Path:
    """The llama.cpp source inside an extracted sdist (build_from_sdist's layout)."""
    return root / "src" / "vendor" / "llama.cpp"


def _found(root: Path, info: dict, src: Path | None = None) -> LlamaCpp | None:
    """The tools under a build dir `root`; the converter in `src`, else in root or above it."""
    def first(names, dirs):
        return next((d / n for n in names for d in dirs if (d / n).is_file()), None)
    bins = [root, root / "bin", root / "build" / "bin"]
    bench, completion = first(["llama-bench"], bins), first(["llama-completion", "llama-cli"], bins)
    converter = first(["convert_hf_to_gguf.py"], [src] if src else [root, *root.parents[:3], _vendored(root.parent)])
    if not (bench and completion and converter):
        return None
    return LlamaCpp(bench, completion, converter, info, first(["llama-quantize"], bins))


def _missing(root: Path):
    raise SystemExit(f"--llama-cpp {root}: needs llama-bench and llama-completion (or llama-cli) in it, "
                     "its bin/ or build/bin/, and convert_hf_to_gguf.py in it, up to 3 levels above, or in "
                     "../src/vendor/llama.cpp (the sdist build's layout)")


def build_from_sdist(cache: Path, jobs: int, log=print) -> LlamaCpp:
    """pip download the llama-cpp-python sdist, cmake-build its vendor/llama.cpp: Release, native."""
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                        SDIST, "-d", tmp], check=True)
        sdist = next(Path(tmp).glob(f"{SDIST}-*.tar.gz"))
        version = sdist.name[len(SDIST) + 1:-len(".tar.gz")]
        root = cache / version
        if root.exists():
            shutil.rmtree(root)       # a build that never finished (build.json is written last)
        _extract(sdist, root / "src")
    commit = vendored_commit(root / "src")
    flags = [*CMAKE_FLAGS, f"-DLLAMA_BUILD_COMMIT={commit}"]
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    log(f"# building llama.cpp {commit} (llama-cpp-python {version}) in {root}: {jobs} jobs, a few minutes")
    t0 = time.perf_counter()
    src, build = _vendored(root), root / "build"
    subprocess.run(["cmake", "-S", src, "-B", build, *gen, *flags], check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", build, "-j", str(jobs), "--target", *TARGETS], check=True)
    info = {"source": f"{SDIST}-{version} sdist", "commit": commit, "cmake_flags": flags,
            "build_s": round(time.perf_counter() - t0, 1), "built": time.strftime("%Y-%m-%d %H:%M")}
    (root / "build.json").write_text(json.dumps(info, indent=1))
    return _found(build, info, src) or _missing(build)


def _extract(sdist: Path, dest: Path) -> None:
    """The sdist's vendor/llama.cpp and its CHANGELOG (which names the vendored commit)."""
    with tarfile.open(sdist) as tar:
        top = tar.getnames()[0].split("/")[0]
        keep = [m for m in tar.getmembers()
                if m.name.startswith(f"{top}/vendor/llama.cpp/") or m.name == f"{top}/CHANGELOG.md"]
        for m in keep:
            m.name = m.name[len(top) + 1:]
        tar.extractall(dest, members=keep, filter="data")


def vendored_commit(src: Path) -> str:
    """The llama.cpp commit the sdist vendors: its CHANGELOG's newest 'llama.cpp@<hash>' entry."""
    text = (src / "CHANGELOG.md").read_text(errors="replace") if (src / "CHANGELOG.md").is_file() else ""
    m = re.search(r"llama\.cpp@([0-9a-f]{7,40})", text)
    return m.group(1) if m else "unknown"


# --- conversion -------------------------------------------------------------------------------

# Runs the converter with one change, made in memory: a tokenizer whose pre-tokenizer hash is not in
# its table (ours: byte-level BPE with the GPT-2 regex) gets `fallback` instead of an error. Works
# for both layouts: TextModel in conversion/base.py (newer) or in the script itself (older).
_SHIM = """
import importlib.util, logging, sys
from pathlib import Path
converter, fallback = sys.argv[1], sys.argv[2]
sys.argv = [converter] + sys.argv[3:]
sys.path.insert(0, str(Path(converter).parent))
spec = importlib.util.spec_from_file_location("convert_hf_to_gguf", converter)
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
base = sys.modules.get("conversion.base", mod)
cls = getattr(base, "TextModel", None) or getattr(mod, "Model")
known = cls.get_vocab_base_pre
def pre(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:
        logging.warning("pre-tokenizer hash not in this llama.cpp's table: using %r", fallback)
        return fallback
cls.get_vocab_base_pre = pre
mod.main()
"""


def convert(lc: LlamaCpp, hf_dir: Path, out: Path, python: str, pre_tokenizer: str, log=print) -> Path:
    """`out` (bf16 GGUF of hf_dir), converted unless it is already there."""
    if out.is_file():
        return out
    probe = subprocess.run([python, "-c", "import torch, transformers, numpy, yaml, tqdm"],
                           capture_output=True, text=True)
    if probe.returncode:
        raise SystemExit(f"llama.cpp's converter needs {CONVERT_DEPS} in --convert-python {python}: "
                         f"{probe.stderr.strip().splitlines()[-1:]}; `{python} -m pip install {CONVERT_DEPS}` "
                         "or pass a python that has them")
    log(f"# converting {hf_dir} to {out.name} with {lc.converter}")
    partial = out.with_suffix(".partial")
    subprocess.run([python, "-c", _SHIM, lc.converter, pre_tokenizer, hf_dir, "--outtype", "bf16",
                    "--outfile", partial], check=True, stdout=subprocess.DEVNULL)
    partial.rename(out)           # only a finished file carries the final name
    return out


def quantize(lc: LlamaCpp, src: Path, qtype: str, threads: int, log=print) -> Path:
    """src (a bf16 GGUF) quantized by llama-quantize to qtype (Q8_0, Q4_K_M, ...) beside it, once."""
    out = src.with_name(f"model-{qtype.lower()}.gguf")
    if out.is_file():
        return out
    if lc.quantizer is None:
        raise SystemExit(f"--quant needs llama-quantize beside {lc.bench} (build its llama-quantize target)")
    log(f"# quantizing {src.name} to {out.name} with {lc.quantizer}")
    partial = out.with_suffix(".partial")
    run = subprocess.run([lc.quantizer, src, partial, qtype, str(threads)], stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
    if run.returncode:
        partial.unlink(missing_ok=True)
        raise SystemExit(f"llama-quantize {qtype} failed: {run.stderr.strip().splitlines()[-1:]}")
    partial.rename(out)
    return out


# --- command lines and outputs ----------------------------------------------------------------

def bench_cmd(lc: LlamaCpp, gguf: Path, threads: int, prompt: int, gen: int, depth: int = 0) -> list:
    """One llama-bench test, one repetition (the caller repeats by process); depth needs -d."""
    cmd = [lc.bench, "-m", gguf, "-t", threads, "-p", prompt, "-n", gen, "-r", 1, "-o", "json"]
    return cmd + (["-d", depth] if depth else [])


def bench_tok_s(stdout: str) -> float:
    """tok/s of the one test in llama-bench's JSON output."""
    return float(json.loads(stdout)[0]["avg_ts"])


def bench_record(stdout: str) -> dict:
    rec = json.loads(stdout)[0]
    return {k: rec.get(k) for k in ("build_commit", "build_number", "cpu_info", "backends", "n_threads",
                                    "n_batch", "n_ubatch", "type_k", "type_v", "use_mmap", "flash_attn")}


def supports_depth(lc: LlamaCpp) -> bool:
    """Whether llama-bench has -d (a context depth before the timed test; added in 2025)."""
    help_text = subprocess.run([lc.bench, "--help"], capture_output=True, text=True)
    return "--n-depth" in help_text.stdout + help_text.stderr


def completion_cmd(lc: LlamaCpp, gguf: Path, threads: int, text: str, n: int, ctx: int,
                   session: Path | None = None) -> list:
    """Greedy completion of raw text; stdout carries only generated text (no prompt echo, no chat)."""
    cmd = [lc.completion, "-m", gguf, "-t", threads, "-c", ctx, "-p", text, "-n", n, "--temp", 0,
           "--ignore-eos", "-no-cnv", "--no-display-prompt"]
    return cmd + (["--prompt-cache", session, "--prompt-cache-all"] if session else [])


def session_tokens(path: Path) -> list[int]:
    """Token ids (prompt, then generated) of a llama.cpp session file: magic, version, count, ids."""
    data = path.read_bytes()
    magic, _version, n = struct.unpack_from("<III", data)
    if magic != SESSION_MAGIC:
        raise ValueError(f"{path}: not a llama.cpp session file (magic {magic:#x})")
    return list(struct.unpack_from(f"<{n}i", data, 12))
