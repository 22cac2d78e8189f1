"""The house rules of docs/architecture.md, checked on the source: imports run one way down the
floors (server -> engine -> models -> moe -> kernels -> device -> ground), no import circle outside
the emulated device, and the line budget (modules, functions, the whole package).

Imports are read from the source with ast, function-level (lazy) imports included: a lazy import
is still a dependency. Code lines: non-blank lines that are not comments or docstrings.
"""
from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "freetoken"

# Highest floor first. A module may import its own floor or any floor below, never one above.
FLOORS = (
    ("commands", ("freetoken.cli", "freetoken.__main__", "freetoken.commands")),
    ("server", ("freetoken.server", "freetoken")),   # freetoken/__init__.py: the public API (LLM)
    ("engine", ("freetoken.engine",)),
    ("models", ("freetoken.models", "freetoken.models.demo")),
    ("moe", ("freetoken.moe",)),
    ("kernels", ("freetoken.kernels", "freetoken.backend")),
    ("device", ("freetoken.cupy_loader", "freetoken.cuda_emu", "freetoken.device_limits")),
    ("ground", ("freetoken.config", "freetoken.env", "freetoken.log", "freetoken.progress",
                "freetoken.flags", "freetoken.harnesses", "freetoken.tokenizer", "freetoken.grammar")),
)
CIRCLES_ALLOWED_UNDER = "freetoken.cuda_emu"   # the emulator mirrors CuPy's own mutual imports

MAX_MODULE_LINES = 300      # code lines per module
MAX_FUNCTION_LINES = 40     # code lines per function or method
# the whole package; raising it is a decision for review, not a reflex. 15,000 -> 15,300
# (2026-12-04): the emulator's race, stream-hazard, slack and launch-limit checks (~320 lines);
# -> 15,500 (2026-12-04): quantized prefill on AMX-INT8 tiles (~195), the stream-order fuzz, the
# non-finite rules of attention, the norms and gdn; -> 15,550 (2026-12-04): the first-contact
# fixes of the server (shortened max_tokens, the drain's /health, stamped log lines, error reasons,
# refused tool results and media types, the --model advice); -> 15,600 (2026-12-04): the drain's
# exit code and the thread tuner's held lines; -> 15,650 (2026-12-04): tool_choice auto's
# triggered grammar (a compile check remembered per tool set, the optional thought before any
# grammar, dropped unparsable calls); -> 15,700 (2026-12-04): tools' schemas checked against
# their meta-schema (server/tool_schemas.py), the gateway gauges under vLLM's names, priority 0
# accepted; -> 15,800 (2026-12-04): GGUF MXFP4 blocks (kernels/qmxfp4.py, its int8 dot and the format's
# entries: ~60 lines), the first piece of gpt-oss; -> 15,850 (2026-12-04): what the first real GPU
# (an H200) showed the emulator lacked: CUDA's own refusal codes, the loaded kernel's
# max_threads_per_block (asked by gdn_rule, answered by the emulated kernel too) (~20 lines);
# -> 16,050 (2026-12-04): a Qwen3-MoE decode layer's attention half and router in one numba call
# (kernels/decode_layer.py, ~165 lines: the Python and dispatch between ~17 op calls a layer were
# ~1 ms of a 6.9 ms step on the medium Q4_K_M file), the thread tuner's alternating tries;
# -> 16,100 (2026-12-04): glibc malloc keeps freed prefill scratch (engine/host_malloc.py, ~30
# lines: ~32,000 page faults a 512-token prompt of a GGUF file, 10-15% of its prefill on the VM);
# -> 16,250 (2026-12-05): bf16 experts' prefill on AVX512-BF16 (kernels/experts_bf16.py and
# _simd_bf16.py, ~135 lines: a 512-token prefill of the medium bf16 model 1.6 -> 1.1 s on Zen 4);
# -> 16,375 (2026-12-05): the int8 row dots' sub-block integer sums and q8_0's eight-block step
# (~40 lines: q4_k's GEMV 3.2 -> 3.6x the fp32 dots, bench/kernels/quant_dots.py, Zen 4 VM; a whole
# decode step did not move measurably, docs/performance.md), the thread tuner's look
# at /proc/stat before its start try (~40: ~3% of every short decode), kernels that read numba's
# target so NUMBA_CPU_NAME=generic runs (~15), a preloaded malloc named and left alone (~17)
# -> 16,400 (2026-12-05, evening): the decode GEMVs ask for their weight rows ahead
# (_simd.prefetch_ahead and its IR, ~25 lines: a Q4_K_M decode step of the medium model
# 13.5-17.5 -> 9.4-12.7 ms in 3 interleaved pairs, bf16 ~6%, Xeon EMR VM; docs/performance.md)
# -> 16,420 (2026-12-05, night): the tile GEMMs' runs of row ranges and their add into the
# experts' output (kernels/_tile_out.py, ~20 lines net: the q4_k/q6_k GEMMs of a 512-token
# prefill 0.82-0.94x the time in-process, and a [P,H] pass of ~5% of the prefill gone, Xeon EMR VM)
# -> 16,440: the gate_up GEMM pairing a row with its up row for the silu (~20 lines: a 64-expert
# q4_k gate_up and its silu at 512 tokens 19.0 -> 16.7-17.3 ms in-process, the same numbers, Xeon EMR VM)
# -> 16,460: decode attention asks for the KV records 8 slots ahead of the one it reads
# (_simd.prefetch_row beside prefetch_ahead, one IR for both, ~18 lines: attention_decode.run at
# batch 1, bf16 KV streamed from memory, 5 interleaved rounds each: 4,096 contiguous slots 0.75-0.81x
# the time, 16,384 shuffled slots 0.24-0.36x, Xeon EMR VM; docs/performance.md)
# -> 16,620: decode attention's scores and weighted V rows as LLVM IR (kernels/_simd_attn.py, 4 heads
# x 4 slots per shuffle tree, 4 heads x 64 values of sums in registers; the softmax max reduced as
# integers; ~155 lines: attention_decode.run at batch 1, bf16 KV from memory, 3 interleaved rounds:
# 4,096 contiguous slots 0.55-0.72x the time, 16,384 shuffled 0.59-0.64x, Xeon EMR VM)
# -> 16,630: which decode attention path runs for the model's heads, said at start-up and by
# `kernel attention` (~10 lines; the CPU-speed issue asks each kernel report to name its path)
# -> 16,650 (2026-12-06): MXFP4's int8 row dot eight blocks a step, the values offset to unsigned
# (_simd_int8._mxfp4_eight, ~20 lines: quant_dots mxfp4 int8 1.1-1.3x in cache and from memory,
# kernel experts T=1 ~0.94x the time, 6 interleaved rounds, EPYC Zen 4 VM)
# -> 16,690: a one-token decode step's routed experts in the layer's numba call too, on the host
# bank the MoE runtime's cpu backend hands over (decode_layer._layer, runtime.inline_bank; ~37
# lines: Q4_K_M medium decode 0.85-0.99x the time per token, median 0.96, in 6 interleaved pairs;
# MXFP4_MOE 0.94-0.99 in 3 of 4, EPYC Zen 4 VM)
# -> 16,725: bf16 banks' decode experts in the layer's call too (kernels/experts_pairs.py, the
# bf16-pair GEMV and its roundings in one numba call; ~34 lines: bf16 medium decode 0.92-1.07x the
# time per token, median 0.96, 5 of 6 interleaved pairs faster, EPYC Zen 4 VM)
# -> 16,735: Q8_0's eight-block dot on its own, quants offset to unsigned on VNNI and the 8 fp16
# scales by one shuffle (_simd_int8._q8_0_eight, _fp16_eight; ~10 lines: quant_dots q8_0 in cache
# median 49.5 against 43.6 G weights/s in 7 interleaved pairs, EPYC Zen 4 VM)
# -> 16,885: bf16 experts' decode rows dotted by vdpbf16ps against bf16 words of x (_simd_bf16's
# row dots with their fp32 fallback, experts_pairs' word kernels, the widened path kept for CPUs
# without AVX512-BF16; ~150 lines: bf16 medium decode step 0.93-0.97x the time, 4 of 4
# interleaved pairs, EPYC Zen 4 VM)
# -> 17,045 (2026-12-06): int8 row dots and int8 tile GEMMs for every other GGUF block format (q4_0, q4_1,
# q5_0, q5_1, q2_k, q3_k: kernels/_simd_int8_low.py and the tile groups; ~160 lines: Q4_0 and
# Q3_K_M files decoded at 0.24x and 0.48x llama.cpp through the fp32 block dots, EPYC Zen 4 VM)
# -> 17,135 (2026-12-06, later): kernels/_peak.py, the CPU's compute peak measured on the instruction an
# op multiplies with, so `kernel --bench` gives prefill shapes a FLOP/s share as the CPU-speed issue
# asks (~90 lines: before, the CPU's FLOP/s line had no peak at all)
# -> 17,215 (2026-12-06, later): the int8 tile GEMM as unpack + 4-row x 2-tile products (kernels/
# _simd_igemm.py; ~65 lines over the one-row kernels it replaced: a Q5_K_M prefill of 512 tokens
# 1.4x as fast, EPYC Zen 4 VM)
# -> 17,310 (2026-12-07): kernels/decode_stack.py, every layer of a one-token decode step in one
# numba call (~75 lines; a Q4_0 medium decode step 3.2% faster than one call a layer, the same
# process alternating, EPYC Zen 4 VM), and per-layer slots kept in kernels/decode_layer.py
# -> 17,560 (2026-12-07, later): q4_0 expert banks interleaved 16 rows at a time at load for the cpu
# backend (kernels/qlayout.py, qinterleave.py, _simd_interleave.py, engine/build.interleaved_q4_0;
# ~250 lines: a q4_0 experts decode call 1.8x as fast in cache and 1.2x from DRAM, the Q4_0 decode
# step ~1.1x, the one cell of the CPU-speed table below llama.cpp on the EPYC Zen 4 VM)
# -> 17,900 (2026-12-07, gpt-oss): a new family on the ref and cpu backends (models/gpt_oss.py,
# gpt_oss_weights.py with the hub's MXFP4 experts, rope_freqs.py's YaRN; attention sinks and sliding
# windows in the CPU attention kernels; experts with biases and the clamped SwiGLU, kernels/
# experts_glu.py; ~330 lines, two Qwen copies of the RoPE frequencies folded into one on the way)
# -> 18,080 (2026-12-07, gpt-oss later): its GGUF (models/gguf_gpt_oss.py, ~70 lines) and the
# synth:gpt-oss-20b / gpt-oss-120b presets with MXFP4 experts at the real geometry (synth_gpt_oss.py
# and synth.py's hooks, ~100 lines): what the family's benchmarks against llama.cpp will run on
# -> 18,240 (2026-12-07, gpt-oss's harmony): its output parsed on every chat route (server/harmony.py,
# ~95 lines; openai-harmony 0.0.8 downloads its vocabulary on first use, so it cannot run offline),
# the request's effort to the template, SamplingParams.skip_special_tokens; synth_export writing the
# gpt-oss presets as the hub ships them (~30 lines) for the llama.cpp comparison
# -> 18,260 (2026-12-07, the gpt-oss review): transformers' gpt-oss config defaults, YaRN's factor on
# Qwen3-MoE's scores (and refused with partial rotary dims), a harmony GGUF's <|end|> not a stop token
# -> 18,300 (2026-12-07): gpt-oss on cuda and through the expert cache: the kernels' sinks, window,
# bias and glu arguments, biases gathered by slot for the cache's calls and host copies for the CPU
# branch (the plan's gpt-oss refusals removed); -> 18,330 (2026-12-07): gpt-oss's prefill on the
# int8 tile GEMM (experts_glu.tile_gemm), the hub's MXFP4 re-packed by a numba kernel, bench bw
# reading a quantized checkpoint's expert format; -> 18,345 (2026-12-07): harmony's grammars (a
# forced tool call in gpt-oss's call form, a JSON format as its final message) in place of the 400
# -> 18,470 (2026-12-07): gpt-oss's sliding layers' KV as per-request rings (engine/window_pool.py,
# ~90 lines) joining the state checkpoints, whose pool now moves whatever parts a state pool names;
# -> 18,480 (2026-12-07): harmony's tool_choice auto held to its message structure (grammar.py)
# -> 18,525 (2026-12-07): the terminal commands show a harmony model's channels apart
# (commands/channels.py, ~45 lines), the attention kernels' sinks pointer named once
# -> 18,540 (2026-12-08): decode attention's block kernels ask for their KV pieces ahead
# (_simd_attn._keys_ahead, _simd_ir.prefetch_span)
# -> 18,645 (2026-12-08): a GGUF file's header read in one pass (models/gguf_header.py, ~100
# lines): gguf-py's reader took 6.3-6.7 s to open a file with a real vocabulary, this 0.10 s
MAX_PACKAGE_LINES = 18_645


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(path: Path, modules: dict[str, Path]) -> list[tuple[str, int]]:
    """(imported freetoken module, line) for every import in the file, lazy ones included;
    `from pkg import mod` counts as importing pkg.mod."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("freetoken"):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                out.append((sub if sub in modules else node.module, node.lineno))
        elif isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names if a.name.startswith("freetoken")]
    return out


def _floor(module: str) -> tuple[int, str]:
    """(height, floor name) by the longest matching prefix."""
    best = None
    for height, (name, prefixes) in enumerate(reversed(FLOORS)):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > best[0]):
                best = (len(prefix), height, name)
    assert best is not None, f"{module} stands on no floor: add it to FLOORS in {__file__}"
    return best[1], best[2]


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: {t for t, _ in _imports(p, modules) if t != m} for m, p in modules.items()}


def test_imports_run_down_the_floors():
    modules = _modules()
    upward = []
    for name, path in modules.items():
        here = _floor(name)
        for target, line in _imports(path, modules):
            there = _floor(target)
            if there[0] > here[0]:
                upward.append(f"{path.relative_to(PACKAGE.parent)}:{line} ({here[1]}) imports {target} ({there[1]})")
    assert not upward, "imports running back up a floor:\n" + "\n".join(upward)


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circles_outside_the_emulator():
    graph = _graph()
    circles = [c for c in _circles(graph) if not all(m.startswith(CIRCLES_ALLOWED_UNDER) for m in c)]
    assert not circles, f"modules importing each other in a circle: {circles}"


def test_the_circle_finder_sees_a_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _code_lines(source: str) -> tuple[set[int], ast.Module]:
    tree = ast.parse(source)
    docstrings = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and body:
            first = body[0]
            if isinstance(first, ast.Expr) and isinstance(getattr(first, "value", None), ast.Constant) \
                    and isinstance(first.value.value, str):
                docstrings.update(range(first.lineno, first.end_lineno + 1))
    skip = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER)
    lines = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in skip:
            lines.update(range(tok.start[0], tok.end[0] + 1))
    return lines - docstrings, tree


def test_code_lines_skip_comments_and_docstrings():
    lines, _ = _code_lines('"""doc\nstring"""\n# comment\n\nx = 1\ndef f():\n    """d"""\n    return x\n')
    assert lines == {5, 6, 8}


@pytest.fixture(scope="module")
def budget():
    files, functions = {}, {}
    for path in sorted(PACKAGE.rglob("*.py")):
        lines, tree = _code_lines(path.read_text())
        where = str(path.relative_to(PACKAGE.parent))
        files[where] = len(lines)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                functions[f"{where}:{node.lineno} {node.name}"] = sum(
                    1 for n in lines if node.lineno <= n <= node.end_lineno)
    return files, functions


def test_modules_stay_small(budget):
    files, _ = budget
    over = {f: n for f, n in files.items() if n > MAX_MODULE_LINES}
    assert not over, f"modules over {MAX_MODULE_LINES} code lines (split by role): {over}"


def test_functions_stay_short(budget):
    _, functions = budget
    over = {f: n for f, n in functions.items() if n > MAX_FUNCTION_LINES}
    assert not over, f"functions over {MAX_FUNCTION_LINES} code lines: {over}"


def test_the_package_stays_within_its_budget(budget):
    files, _ = budget
    total = sum(files.values())
    assert total <= MAX_PACKAGE_LINES, f"{total} code lines in freetoken/, budget {MAX_PACKAGE_LINES}"
