"""Per-token cost of grammar-constrained decoding on the CPU path, for each candidate grammar
engine (llguidance, xgrammar, outlines-core); pairs: docs/constrained-decoding.md.

    python bench/grammar_mask.py [--engines llguidance,xgrammar,outlines-core]
        [--tokenizers demo,qwen-like] [--big-tokenizer PATH] [--passes 5] [--timeout 900]
        [--step-ms 3.3,33,100] [--out bench/results/grammar_mask.json]

None of the engines is a FreeToken dependency: run this in a throwaway venv that has `tokenizers`,
`numpy` (and `numba`, for the numba mask-apply row) plus the engines to compare; an engine that is
not installed is skipped with a line saying so.

Tokenizers: 'demo' is the packaged model's (freetoken/data/tiny-agent-moe: tiny-coder-moe's 4,000 tokens, logits
4,096 wide); 'qwen-like' is a Qwen3-shaped byte-level BPE (Qwen's pre-tokenizer regex, 151,643 BPE
tokens + Qwen's 26 added tokens = 151,669, logits 151,936 wide). With no hub access the script
trains it with `tokenizers` on 120 MB of local text: this Python's stdlib sources, then the
installed packages' sources and docs (1-2 minutes), and caches it under ~/.cache/freetoken/bench/
(--big-tokenizer PATH names another tokenizer.json, e.g. a real Qwen3 one).

Grammars: tool_schema (JSON schema of a tool call: `name` enum of 3 tools, `arguments` object
with a string, an integer with bounds and a boolean), json_object (any JSON object), tool_wrapper
(Qwen's chat-template form `<tool_call>\\n{tool_schema JSON}\\n</tool_call>`: literal text and
added tokens around a JSON-schema sub-grammar). Each is followed over a fixed valid text tokenized
the ordinary way (~200 tokens with the qwen-like tokenizer), then the end-of-turn token.

Per (engine, tokenizer) one worker subprocess (so imports, memory and a runaway compile stay
apart; --timeout ends it) runs on 1 thread (RAYON/OMP/numba threads = 1, compiler threads = 1):
  tokenizer: building the engine's tokenizer object, once.
  compile:   grammar -> the engine's compiled object, median of --passes fresh compiles (caches
             off where the engine has one).
  cold:      a fresh matcher right after a compile: per-token mask (the allowed-token bitmask,
             int32[ceil(V/32)]) and advance (feed the sampled token) times, median / p99 / max;
             lazily-built engines pay their lexer/DFA construction here, as the first request
             with a new schema does.
  warm:      --passes - 1 more passes from the same compiled grammar (a server that caches it).
Checks per pass: every token of the text allowed by the mask before it, the end-of-turn token
allowed at the end, and how many added tokens (<|im_end|>, <tool_call>, ...) the mask allows
inside a JSON string (they should be 0: the model must not end the turn or open a tool call
in the middle of an argument).

Mask apply: setting disallowed logits to -inf in an f32[V] row, engine-independent: numpy
unpackbits + copyto, a numba loop, and llguidance's own numpy helper.

The step comparison puts (mask p50 + advance p50 + apply) against decode steps of --step-ms (default:
the demo model at ~300 tok/s = 3.3 ms; a 30B MoE on CPU at 30 and 10 tok/s = 33 and 100 ms).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

for _v in ("RAYON_NUM_THREADS", "OMP_NUM_THREADS", "NUMBA_NUM_THREADS", "MKL_NUM_THREADS",
           "OPENBLAS_NUM_THREADS", "TOKENIZERS_PARALLELISM"):
    os.environ.setdefault(_v, "1" if _v != "TOKENIZERS_PARALLELISM" else "false")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))   # bench/ also when imported, not run

# _machine needs only the stdlib, so this runs in a venv without freetoken (see above)
from _machine import cpu_info  # noqa: E402

DEMO_DIR = ROOT / "freetoken" / "data" / "tiny-agent-moe"   # tiny-coder-moe's vocabulary
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "freetoken" / "bench"
ENGINES = {"llguidance": "llguidance", "xgrammar": "xgrammar", "outlines-core": "outlines_core"}
QWEN_LOGITS = 151936
EOT = "<|im_end|>"

# --- the workload -----------------------------------------------------------------------------

TOOL_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"enum": ["get_weather", "search_code", "run_tests"]},
        "arguments": {
            "type": "object",
            "properties": {
                "query": {"type": "string"},
                "max_results": {"type": "integer", "minimum": 1, "maximum": 50},
                "include_tests": {"type": "boolean"},
            },
            "required": ["query", "max_results", "include_tests"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}
OBJECT_SCHEMA = {"type": "object"}

_QUERY = ("Find every place in the scheduler where a request that was preempted while its prefix "
          "was still being computed is put back on the waiting queue, and check whether the number "
          "of computed tokens is reset before the blocks are freed; the bug report says that after "
          "a burst of long prompts the engine sometimes resumes a request from a stale position, so "
          "look at the radix cache eviction path too, in particular the code that splits a node "
          "when only part of a cached prefix matches, and list the functions with their file names "
          "and line numbers, together with a short note on how each one handles a request whose KV "
          "blocks were taken by another request in the same step. Skip vendored code, generated files "
          "and the benchmarks; for each function also say which tests reach it, if any, and "
          "whether those tests run a preemption at all.")
TOOL_CALL = {"name": "search_code",
             "arguments": {"query": _QUERY, "max_results": 20, "include_tests": False}}
OBJECT_DOC = {
    "id": 48213, "title": "Streaming stops after a tool call when the client sends stream_options",
    "state": "open", "labels": ["bug", "server", "streaming"],
    "author": {"login": "maria-k", "id": 99120, "site_admin": False},
    "assignees": [{"login": "devon"}, {"login": "li.wei"}],
    "created_at": "2025-03-14T09:26:53Z", "comments": 7, "locked": False, "milestone": None,
    "reactions": {"+1": 12, "eyes": 3, "confused": 0},
    "body": "With stream=true and include_usage the last chunk arrives twice and the second one "
            "has an empty choices list; the SDK then raises. Seen with two tools offered.",
    "events": [{"type": "labeled", "label": "bug", "at": 1710408413.5},
               {"type": "assigned", "who": "devon", "at": 1710412001.25}],
}


def texts():
    """grammar kind -> the valid text the model 'generates' (then the end-of-turn token)."""
    call = json.dumps(TOOL_CALL)
    return {"tool_schema": call, "json_object": json.dumps(OBJECT_DOC),
            "tool_wrapper": "<tool_call>\n" + call + "\n</tool_call>"}


# --- tokenizers -------------------------------------------------------------------------------

QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
              r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>",
                "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>",
                "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
                "<|image_pad|>", "<|video_pad|>"]                      # ids 151643..151656
QWEN_PLAIN = ["<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
              "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>",
              "</tool_response>", "<think>", "</think>"]               # 151657..151668, special=false


def train_qwen_like(path: Path, limit: int = 120_000_000) -> None:
    """A Qwen3-shaped byte-level BPE trained on this Python's stdlib sources, then installed
    packages' sources and docs (up to `limit` bytes: the stdlib alone runs out of merges
    before 151,643)."""
    import sysconfig
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    std = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in std.rglob("*.py") if "site-packages" not in p.parts)
    for sp in sorted({p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir()}):
        files += sorted(p for p in Path(sp).rglob("*")
                        if p.suffix in (".py", ".pyi", ".md", ".rst", ".txt") and p.is_file())
    corpus = CACHE / "train-corpus.txt"
    corpus.parent.mkdir(parents=True, exist_ok=True)
    size, used = 0, 0
    with open(corpus, "w", encoding="utf-8") as out:
        for f in files:
            if size >= limit:
                break
            try:
                text = f.read_bytes().decode("utf-8", "ignore")
            except OSError:
                continue
            size += out.write(text)
            used += 1
    files = files[:used]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=151643, min_frequency=1, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    t0 = time.time()
    print(f"training the qwen-like tokenizer on {len(files)} local source files "
          f"({corpus.stat().st_size / 1e6:.0f} MB) ...", flush=True)
    tok.train([str(corpus)], trainer)
    tok.add_special_tokens(QWEN_SPECIAL)
    tok.add_tokens(QWEN_PLAIN)
    corpus.unlink()
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    print(f"  {tok.get_vocab_size()} tokens in {time.time() - t0:.0f} s -> {path}", flush=True)
    if tok.get_vocab_size() < 151669:
        print("  (fewer than Qwen3's 151,669: this machine has too little local text)")


def tokenizer_spec(name: str, big: str | None) -> dict:
    if name == "demo":
        cfg = json.loads((DEMO_DIR / "config.json").read_text())
        return dict(name=name, path=str(DEMO_DIR / "tokenizer.json"), logits=cfg["vocab_size"])
    if name == "qwen-like":
        path = Path(big) if big else CACHE / "qwen-like-151936.json"
        if not path.exists():
            train_qwen_like(path)
        return dict(name=name, path=str(path), logits=QWEN_LOGITS)
    return dict(name=Path(name).stem, path=name, logits=None)   # any tokenizer.json


def byte_decoder() -> dict:
    """GPT-2 byte-level alphabet: printable char -> byte."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


# --- engines ----------------------------------------------------------------------------------
# Each adapter: tokenizer(tk, V) once; compile(kind) -> compiled; matcher(compiled) -> m;
# fill(m, mask) writes mask[:] (int32 bitmask, bit i of word i>>5 = token i allowed); advance(m, t).

def lark_json(schema) -> str:
    return json.dumps(schema)


class LLGuidance:
    name = "llguidance"

    def tokenizer(self, tk, V, eot):
        import llguidance as llg
        self.llg = llg
        self.tok = llg.LLTokenizer(tk.to_str(), n_vocab=V, eos_token=eot)

    def grammar(self, kind):
        llg = self.llg
        if kind == "tool_schema":
            return llg.LLMatcher.grammar_from_json_schema(TOOL_SCHEMA)
        if kind == "json_object":
            return llg.LLMatcher.grammar_from_json_schema(OBJECT_SCHEMA)
        # added tokens are tokens to llguidance (<name> in Lark), not their text
        return llg.LLMatcher.grammar_from_lark(
            'start: <tool_call> "\\n" call "\\n" </tool_call>\n'
            "call: %json " + lark_json(TOOL_SCHEMA) + "\n")

    def compile(self, kind):
        m = self.llg.LLMatcher(self.tok, self.grammar(kind), log_level=0)
        if m.is_error():
            raise RuntimeError(m.get_error())
        return m

    def matcher(self, compiled):
        # a pristine compiled matcher, deep-copied per request (shares nothing mutable)
        return compiled.deep_copy()

    def fill(self, m, mask):
        m.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)

    def advance(self, m, t):
        if not m.consume_token(t):
            raise RuntimeError(m.get_error())


class XGrammar:
    name = "xgrammar"

    def tokenizer(self, tk, V, eot):
        import xgrammar as xgr
        self.xgr = xgr
        n = tk.get_vocab_size()
        vocab = [tk.id_to_token(i) for i in range(n)]
        self.info = xgr.TokenizerInfo(vocab, xgr.VocabType.BYTE_LEVEL, vocab_size=V,
                                      stop_token_ids=[eot])
        self.comp = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)

    def compile(self, kind):
        xgr, c = self.xgr, self.comp
        if kind == "tool_schema":
            return c.compile_json_schema(json.dumps(TOOL_SCHEMA), any_whitespace=True)
        if kind == "json_object":
            return c.compile_builtin_json_grammar()
        g = xgr.Grammar.from_lark('start: "<tool_call>\\n" call "\\n</tool_call>"\n'
                                  "call: %json " + lark_json(TOOL_SCHEMA) + "\n",
                                  tokenizer_info=self.info)
        return c.compile_grammar(g)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, m, mask):
        m.fill_next_token_bitmask(mask[None, :])       # numpy via DLPack

    def advance(self, m, t):
        if not m.accept_token(t):
            raise RuntimeError("token rejected")


class OutlinesCore:
    name = "outlines-core"

    def tokenizer(self, tk, V, eot):
        import outlines_core as oc
        from outlines_core.json_schema import build_regex_from_schema
        self.oc, self.regex = oc, build_regex_from_schema
        dec = byte_decoder()
        added = {t.content: i for i, t in tk.get_added_tokens_decoder().items()}
        vocab: dict[bytes, list[int]] = {}
        for i in range(tk.get_vocab_size()):
            s = tk.id_to_token(i)
            if s in added and i != added.get("<tool_call>") and i != added.get("</tool_call>"):
                continue                   # special tokens: not text (eos is given apart)
            b = s.encode() if s in added else bytes(dec[ch] for ch in s)
            vocab.setdefault(b, []).append(i)
        self.vocab = oc.Vocabulary(eot, vocab)

    def compile(self, kind):
        import re
        if kind == "tool_schema":
            rx = self.regex(json.dumps(TOOL_SCHEMA))
        elif kind == "json_object":
            rx = self.regex(json.dumps(OBJECT_SCHEMA))   # a regex: nesting depth is bounded
        else:
            rx = (re.escape("<tool_call>\n") + "(" + self.regex(json.dumps(TOOL_SCHEMA)) + ")"
                  + re.escape("\n</tool_call>"))
        return self.oc.Index(rx, self.vocab)

    def matcher(self, compiled):
        return self.oc.Guide(compiled)

    def fill(self, m, mask):
        m.write_mask_into(mask.ctypes.data, mask.size, mask.itemsize)

    def advance(self, m, t):
        m.advance(t, return_tokens=False)


ADAPTERS = {"llguidance": LLGuidance, "xgrammar": XGrammar, "outlines-core": OutlinesCore}


# --- measurement ------------------------------------------------------------------------------

def stats_us(ns: list[int]) -> dict:
    if not ns:
        return {}
    s = sorted(ns)
    q = lambda f: s[min(len(s) - 1, int(round(f * (len(s) - 1))))] / 1e3
    return dict(p50=q(0.5), p99=q(0.99), max=s[-1] / 1e3, mean=statistics.fmean(s) / 1e3, n=len(s))


def bit(mask, t) -> int:
    return (int(mask[t >> 5]) >> (t & 31)) & 1


def run_pass(ad, compiled, ids, eot, string_step, added_ids, np):
    words = (ad.V + 31) // 32
    mask = np.zeros(words, np.int32)
    m = ad.matcher(compiled)
    fills, advs, rejected, allowed_counts, specials_in_string = [], [], 0, [], None
    pc = time.perf_counter_ns
    for step, t in enumerate(ids):
        t0 = pc()
        ad.fill(m, mask)
        t1 = pc()
        fills.append(t1 - t0)
        if not bit(mask, t):
            rejected += 1
        if step == string_step:
            specials_in_string = sum(bit(mask, a) for a in added_ids)
        allowed_counts.append(int(np.unpackbits(mask.view(np.uint8)).sum()))
        t2 = pc()
        ad.advance(m, t)
        advs.append(pc() - t2)
    ad.fill(m, mask)
    return dict(fill=fills, advance=advs, rejected=rejected, eot_allowed=bool(bit(mask, eot)),
                specials_in_string=specials_in_string,
                allowed_p50=statistics.median(allowed_counts))


def worker(engine: str, tok_spec: dict, passes: int) -> dict:
    import resource
    import numpy as np
    from tokenizers import Tokenizer
    mod = ENGINES[engine]
    t0 = time.perf_counter()
    try:
        __import__(mod)
    except Exception as e:                       # noqa: BLE001 - report any import failure
        return dict(engine=engine, skipped=f"{type(e).__name__}: {e}")
    import_s = time.perf_counter() - t0
    from importlib.metadata import version
    tk = Tokenizer.from_file(tok_spec["path"])
    eot = tk.token_to_id(EOT)
    V = tok_spec["logits"] or tk.get_vocab_size()
    added_ids = sorted(tk.get_added_tokens_decoder())
    ad = ADAPTERS[engine]()
    ad.V = V
    t0 = time.perf_counter()
    ad.tokenizer(tk, V, eot)
    tok_s = time.perf_counter() - t0
    res = dict(engine=engine, version=version(engine), tokenizer=tok_spec["name"],
               tokenizer_size=tk.get_vocab_size(), V=V, import_s=import_s, tokenizer_s=tok_s,
               grammars={})
    for kind, text in texts().items():
        enc = tk.encode(text, add_special_tokens=False)
        ids = enc.ids
        # a step inside the longest string value (the query / the issue body), half-way in
        needle = _QUERY if kind != "json_object" else OBJECT_DOC["body"]
        at = text.index(json.dumps(needle)[1:-1]) + len(needle) // 2
        string_step = next(i for i, (st, _) in enumerate(enc.offsets) if st >= at)
        g = dict(tokens=len(ids) + 1)             # + the end-of-turn token
        try:
            comp_ns, colds = [], []
            for _ in range(passes):               # each: a fresh compile and its first pass
                c0 = time.perf_counter_ns()
                compiled = ad.compile(kind)
                comp_ns.append(time.perf_counter_ns() - c0)
                colds.append(run_pass(ad, compiled, ids, eot, string_step, added_ids, np))
            warms = [run_pass(ad, compiled, ids, eot, string_step, added_ids, np)
                     for _ in range(passes)]
        except Exception as e:                   # noqa: BLE001 - an engine that can't do it
            g["error"] = f"{type(e).__name__}: {e}"[:300]
            res["grammars"][kind] = g
            continue
        g["compile_ms"] = statistics.median(comp_ns) / 1e6
        g["compile_min_ms"] = min(comp_ns) / 1e6
        # per token position, the fastest of the passes: the engine's own cost, without the
        # preemptions of a shared machine (the raw pooled numbers are kept as *_raw)
        posmin = lambda runs, key: [min(r[key][i] for r in runs) for i in range(len(ids))]
        pool = lambda runs, key: [x for r in runs for x in r[key]]
        g["cold_first_mask_us"] = min(r["fill"][0] for r in colds) / 1e3
        g["cold_mask_us"] = stats_us(posmin(colds, "fill"))
        g["cold_advance_us"] = stats_us(posmin(colds, "advance"))
        g["warm_mask_us"] = stats_us(posmin(warms, "fill"))
        g["warm_advance_us"] = stats_us(posmin(warms, "advance"))
        g["cold_mask_us_raw"] = stats_us(pool(colds, "fill"))
        g["warm_mask_us_raw"] = stats_us(pool(warms, "fill"))
        runs = colds + warms
        g["rejected"] = max(r["rejected"] for r in runs)
        g["eot_allowed"] = all(r["eot_allowed"] for r in runs)
        g["specials_in_string"] = colds[0]["specials_in_string"]
        g["string_step"] = string_step
        g["allowed_p50"] = colds[0]["allowed_p50"]
        res["grammars"][kind] = g
    res["max_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return res


def realistic_masks(V: int, np) -> dict:
    """Bitmasks shaped like a JSON walk's: 'string' (inside a string value: all but ~6% of the
    tokens, those with a quote, backslash or control byte, and the added tokens) and 'structure'
    (after a key: a few hundred tokens)."""
    rng = np.random.default_rng(0)
    dense = np.ones(V, bool)
    dense[rng.choice(V, V * 6 // 100, replace=False)] = False
    sparse = np.zeros(V, bool)
    sparse[rng.choice(V, 300, replace=False)] = True
    pack = lambda a: np.packbits(np.concatenate([a, np.zeros(-V % 32, bool)]),
                                 bitorder="little").view(np.int32)
    return {"string": pack(dense), "structure": pack(sparse)}


def mask_apply(V: int, reps: int = 300) -> dict:
    """-inf outside the mask on an f32[1, V] logits row, by numpy/numba ways: us, per-rep min
    over batches of 10 (a shared machine's preemptions removed), for each realistic mask."""
    import numpy as np
    base = np.random.default_rng(1).standard_normal((1, V)).astype(np.float32)
    ways = {}

    def unpack(lg, mask):
        allowed = np.unpackbits(mask.view(np.uint8), count=V, bitorder="little").view(bool)
        np.copyto(lg[0], np.float32(-np.inf), where=~allowed)
    ways["numpy_unpackbits"] = unpack
    try:
        import numba

        @numba.njit(nogil=True)
        def _branchless(row, m):
            ninf = np.float32(-np.inf)
            for i in range(row.shape[0]):
                row[i] = row[i] if (m[i >> 5] >> (i & 31)) & 1 else ninf

        @numba.njit(nogil=True)
        def _words(row, m):
            n = row.shape[0]
            ninf = np.float32(-np.inf)
            for w in range(m.shape[0]):
                mw = m[w]
                if mw == -1:                       # all 32 allowed: nothing to do
                    continue
                lo = w * 32
                hi = min(lo + 32, n)
                if mw == 0:
                    row[lo:hi] = ninf
                    continue
                for i in range(lo, hi):
                    if not (mw >> (i - lo)) & 1:
                        row[i] = ninf
        ways["numba_branchless"] = lambda lg, mask: _branchless(lg[0], mask)
        ways["numba_words"] = lambda lg, mask: _words(lg[0], mask)
    except ImportError:
        pass
    try:
        from llguidance.numpy import apply_token_bitmask_inplace
        ways["llguidance.numpy"] = lambda lg, mask: apply_token_bitmask_inplace(lg, mask[None, :])
    except ImportError:
        pass
    out = {}
    for mname, mask in realistic_masks(V, np).items():
        ref = base.copy()
        unpack(ref, mask)
        for name, fn in ways.items():
            fn(base.copy(), mask)                  # numba compile
            n = reps if name != "llguidance.numpy" else max(20, reps // 10)
            ns = []
            for _ in range(n):
                lg = base.copy()
                t0 = time.perf_counter_ns()
                fn(lg, mask)
                ns.append(time.perf_counter_ns() - t0)
            assert np.array_equal(lg, ref), name
            batches = [min(ns[i:i + 10]) for i in range(0, len(ns), 10)]
            out[f"{name}/{mname}"] = statistics.median(batches) / 1e3
    return out


# --- install footprint ------------------------------------------------------------------------

def footprint(dist_name: str) -> dict | None:
    """Installed bytes of a distribution and of everything it requires (extras off), from each
    installed dist's RECORD; the requirement markers are evaluated with `packaging` if present."""
    from importlib import metadata
    try:
        metadata.distribution(dist_name)
    except metadata.PackageNotFoundError:
        return None
    try:
        from packaging.requirements import Requirement
    except ImportError:
        Requirement = None

    def deps(d):
        for r in d.requires or []:
            if Requirement:
                req = Requirement(r)
                if req.marker and not req.marker.evaluate({"extra": ""}):
                    continue
                yield req.name
            elif "extra ==" not in r:
                yield r.split(";")[0].split("[")[0].split("<")[0].split(">")[0].split("=")[0] \
                    .split("!")[0].split("~")[0].strip()

    def size(d):
        tot = 0
        for f in d.files or []:
            try:
                tot += (Path(d.locate_file(f))).stat().st_size
            except OSError:
                pass
        return tot

    seen, stack, sizes = set(), [dist_name], {}
    while stack:
        n = stack.pop()
        key = n.lower().replace("_", "-")
        if key in seen:
            continue
        seen.add(key)
        try:
            d = metadata.distribution(n)
        except metadata.PackageNotFoundError:
            sizes[key] = None
            continue
        sizes[key] = size(d)
        stack.extend(deps(d))
    own = sizes.pop(dist_name.lower().replace("_", "-"))
    missing = sorted(k for k, v in sizes.items() if v is None)
    big = sorted(((v, k) for k, v in sizes.items() if v), reverse=True)[:5]
    return dict(own_mb=own / 1e6, with_deps_mb=(own + sum(v for v in sizes.values() if v)) / 1e6,
                deps=sorted(sizes), largest=[f"{k} {v / 1e6:.0f} MB" for v, k in big],
                not_installed=missing, pulls_torch="torch" in sizes)


# --- driver -----------------------------------------------------------------------------------

def fmt(x, nd=0):
    return "-" if x is None else f"{x:,.{nd}f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", default="llguidance,xgrammar,outlines-core")
    ap.add_argument("--tokenizers", default="demo,qwen-like",
                    help="demo, qwen-like, or paths of tokenizer.json files")
    ap.add_argument("--big-tokenizer", default=None, help="tokenizer.json to use as qwen-like")
    ap.add_argument("--passes", type=int, default=5, help="compiles and passes per grammar")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per (engine, tokenizer)")
    ap.add_argument("--step-ms", default="3.3,33,100", help="decode step times to compare with")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "grammar_mask.json"))
    ap.add_argument("--worker", nargs=2, metavar=("ENGINE", "TOKSPEC_JSON"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker[0], json.loads(args.worker[1]), args.passes)))
        return

    import importlib.util
    steps = [float(s) for s in args.step_ms.split(",") if s]
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    toks = [tokenizer_spec(t.strip(), args.big_tokenizer) for t in args.tokenizers.split(",")]
    cpu = cpu_info()["model"]
    print(f"machine: {cpu}, {os.cpu_count()} cpus, Python {platform.python_version()}; 1 thread")

    results, feet = [], {}
    for e in engines:
        if e not in ENGINES:
            print(f"{e}: unknown engine (one of {', '.join(ENGINES)})")
            continue
        if importlib.util.find_spec(ENGINES[e]) is None:
            print(f"{e}: not installed in {sys.prefix} - skipped (pip install {e})")
            continue
        feet[e] = footprint(e)
        for ts in toks:
            t0 = time.time()
            try:
                p = subprocess.run([sys.executable, __file__, "--passes", str(args.passes),
                                    "--worker", e, json.dumps(ts)], capture_output=True, text=True,
                                   timeout=args.timeout)
                lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
                r = json.loads(lines[-1]) if lines else dict(
                    engine=e, tokenizer=ts["name"],
                    error=f"worker rc={p.returncode}: {p.stderr.strip()[-400:]}")
            except subprocess.TimeoutExpired:
                r = dict(engine=e, tokenizer=ts["name"], error=f"timeout after {args.timeout} s")
            r["wall_s"] = time.time() - t0
            if r.get("skipped"):
                print(f"{e}: import failed - skipped ({r['skipped']})")
                break
            results.append(r)
            print(f"  {e} / {ts['name']}: {r['wall_s']:.0f} s"
                  + (f" ERROR {r['error']}" if r.get("error") else ""), flush=True)

    applies = {}
    for ts in toks:
        from tokenizers import Tokenizer
        applies[ts["name"]] = mask_apply(ts["logits"] or Tokenizer.from_file(ts["path"]).get_vocab_size())

    print("\ninstall footprint (installed bytes from RECORD, requirements followed, extras off)")
    print(f"{'engine':14} {'own MB':>7} {'+deps MB':>9} torch  largest deps")
    for e, f in feet.items():
        if f:
            print(f"{e:14} {f['own_mb']:7.1f} {f['with_deps_mb']:9.1f} {'yes' if f['pulls_torch'] else 'no ':5}"
                  f"  {', '.join(f['largest'][:3]) or '-'}"
                  + (f"  (not installed: {', '.join(f['not_installed'])})" if f["not_installed"] else ""))

    print("\nper (engine, tokenizer): import s, tokenizer-object s, peak RSS MB")
    for r in results:
        if not r.get("error"):
            print(f"  {r['engine']:14} {r['tokenizer']:10} V={r['V']:>7,}  import {r['import_s']:.2f} s"
                  f"  tokenizer {r['tokenizer_s']:.2f} s  RSS {r['max_rss_mb']:.0f} MB")

    print("\nµs per token (1 thread); cold = fresh matcher right after compile, warm = later passes")
    hdr = (f"{'engine':14} {'tokenizer':10} {'grammar':12} {'tok':>4} {'compile ms':>10} "
           f"{'1st mask':>9} {'cold p50':>8} {'cold p99':>8} {'warm p50':>8} {'warm p99':>8} "
           f"{'adv p50':>7} {'adv p99':>7}  checks")
    print(hdr)
    for r in results:
        if r.get("error"):
            print(f"{r['engine']:14} {r['tokenizer']:10} ERROR {r['error']}")
            continue
        for kind, g in r["grammars"].items():
            if g.get("error"):
                print(f"{r['engine']:14} {r['tokenizer']:10} {kind:12} {g['tokens']:4} "
                      f"not supported/failed: {g['error'][:90]}")
                continue
            ok = "ok" if g["rejected"] == 0 and g["eot_allowed"] else \
                f"rejected {g['rejected']}, eot {'yes' if g['eot_allowed'] else 'NO'}"
            sp = g["specials_in_string"]
            ok += f"; added tokens in string: {sp}"
            adv = g["warm_advance_us"] or g["cold_advance_us"]
            print(f"{r['engine']:14} {r['tokenizer']:10} {kind:12} {g['tokens']:4} "
                  f"{g['compile_ms']:10.1f} {g['cold_first_mask_us']:9.0f} "
                  f"{g['cold_mask_us']['p50']:8.0f} {g['cold_mask_us']['p99']:8.0f} "
                  f"{fmt(g['warm_mask_us'].get('p50'))+'':>8} {fmt(g['warm_mask_us'].get('p99')):>8} "
                  f"{adv['p50']:7.0f} {adv['p99']:7.0f}  {ok}")

    print("\nmask apply: -inf outside the mask on an f32 logits row, µs (string mask / structure mask)")
    apply_best = {}
    for t, a in applies.items():
        ways = sorted({k.split("/")[0] for k in a})
        cost = {w: max(a[f"{w}/string"], a[f"{w}/structure"]) for w in ways}
        apply_best[t] = min(cost.items(), key=lambda kv: kv[1])
        print(f"  {t:10} " + "; ".join(f"{w} {a[w + '/string']:.0f} / {a[w + '/structure']:.0f}"
                                       for w in ways))

    print("\nshare of a decode step: (warm mask p50 + advance p50 + the fastest apply above) / step")
    print(f"{'engine':14} {'tokenizer':10} {'grammar':12} {'µs/token':>9} "
          + " ".join(f"{f'{s:g} ms':>8}" for s in steps) + "   (p99 mask+adv µs)")
    for r in results:
        if r.get("error"):
            continue
        ap_us = apply_best.get(r["tokenizer"], ("", 0.0))[1]
        for kind, g in r["grammars"].items():
            if g.get("error"):
                continue
            mk = g["warm_mask_us"] or g["cold_mask_us"]
            adv = g["warm_advance_us"] or g["cold_advance_us"]
            us = mk["p50"] + adv["p50"] + ap_us
            g["per_token_us_p50"] = us
            g["step_share"] = {f"{s:g}ms": us / (s * 1e3) for s in steps}
            print(f"{r['engine']:14} {r['tokenizer']:10} {kind:12} {us:9.0f} "
                  + " ".join(f"{100 * us / (s * 1e3):7.1f}%" for s in steps)
                  + f"   {mk['p99'] + adv['p99']:.0f}")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(
        machine=dict(cpu=cpu, cpus=os.cpu_count(), python=platform.python_version(),
                     platform=platform.platform()),
        date=time.strftime("%Y-%m-%d"), args=vars(args), tokenizers=toks, footprint=feet,
        mask_apply_us=applies, apply_best=apply_best, results=results), indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
