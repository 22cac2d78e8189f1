"""Synthetic agent conversations for the built-in models (tools/train_demo.py): a harness's system
prompt and tool list, a user request that needs a tool, the call (the right tool of the listed
ones, arguments from the request that fit its schema), a plausible result, and a final answer
that uses it; some with thinking, several calls, several turns; and tool-free chat. Deterministic
for a seed. Tool lists are the real ones of Claude Code and Codex CLI (names, parameters and
required fields, read from the captured traffic in tests/server/fixtures/harnesses/) and a
generic set; file contents are real standard-library sources and short notes.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CAPTURES = ROOT / "tests" / "server" / "fixtures" / "harnesses"
WORDS = ("apple banana cherry delta echo falcon garden harbor island jungle kettle lemon meadow "
         "nickel orange pepper quartz river silver tiger umbrella violet walnut yellow zebra "
         "hello world project notes todo release draft budget summary meeting").split()
# The live launch tests' first words (tests/server/test_live_launch.py takes them from here): no
# note, path or vocabulary word of the corpus is one of them, so those tests measure copying, not recall.
HELD_OUT_WORDS = ("marble", "copper", "harvest", "planet", "window", "lantern", "tunnel", "rocket", "pencil", "castle")
# Pseudo-words are built from these: English-looking words the code-trained tokenizer splits into 2-5
# pieces, as it splits a user's ordinary words (t|un|nel, ro|cket), which only copying gets right.
ONSETS = ("", "b", "c", "d", "f", "g", "h", "l", "m", "n", "p", "r", "s", "t", "v", "w", "br", "cl", "cr", "dr",
          "fl", "gr", "pl", "pr", "sl", "st", "tr", "sh", "ch", "th")
VOWELS = ("a", "e", "i", "o", "u", "a", "e", "o", "ai", "ea", "oo", "ou")
CODAS = ("", "", "", "n", "r", "l", "s", "t", "st", "nd", "rn", "ck", "ll", "m", "p", "ng", "rk")
DIRS = ("src", "lib", "app", "tests", "docs", "scripts", "pkg")
CWDS = ("/home/user/project", "/home/dev/app", "/tmp/work", "/srv/repo", "/home/ana/code/tool")


@dataclass
class Harness:
    name: str
    system: str          # the system text (the template keeps its first paragraph and cwd lines)
    tools: list          # OpenAI-style tool dicts
    read: str            # tool names by role ('' when the harness has none)
    write: str
    shell: str
    edit: str = ""


def _tool(name: str, props: dict, required: list) -> dict:
    schema = {"type": "object", "properties": {k: {"type": t} for k, t in props.items()}, "required": required}
    return {"type": "function", "function": {"name": name, "description": "", "parameters": schema}}


def _captured_tools(capture: str) -> list:
    body = json.loads((CAPTURES / f"{capture}.json").read_text())["body"]
    out = []
    for t in body["tools"]:
        schema = t.get("input_schema") or t.get("parameters")
        if t.get("name") and isinstance(schema, dict):
            out.append({"type": "function", "function": {"name": t["name"], "description": "",
                                                         "parameters": schema}})
    return out


def harnesses() -> list[Harness]:
    claude_sys = ("You are an interactive agent that helps users with software engineering tasks.\n\n"
                  "# Environment\n - Primary working directory: {cwd}\n - Platform: linux")
    codex_sys = "You are a coding agent running in the Codex CLI, a terminal-based coding assistant."
    generic = [_tool("read_file", {"path": "string"}, ["path"]),
               _tool("write_file", {"path": "string", "content": "string"}, ["path", "content"]),
               _tool("list_dir", {"path": "string"}, ["path"]),
               _tool("run_command", {"command": "string"}, ["command"])]
    return [Harness("claude", claude_sys, _captured_tools("claude-1"), "Read", "Write", "Bash", "Edit"),
            Harness("codex", codex_sys, _captured_tools("codex-1"), "", "", "exec_command"),
            Harness("generic", "You are a helpful coding assistant with tools.", generic, "read_file",
                    "write_file", "run_command")]


def vocabulary(stdlib: list[Path]) -> list[str]:
    """Thousands of lower-case words (identifier parts of the sources, 3-12 letters): what notes,
    file names and directories are made of, so that the model learns to copy any word rather than
    to recall a short list."""
    import re
    words = set(WORDS)
    for path in stdlib:
        words.update(w for w in re.findall(r"[a-z]{3,12}", path.read_text(errors="replace")))
    return sorted(words - set(HELD_OUT_WORDS))


def token_pieces() -> list[str]:
    """The tokenizer's pieces that are lower-case letters alone (1,603 of 4,096): the alphabet a
    copied word is made of; a token the model never had to copy is one it cannot copy."""
    import re

    from freetoken.models.demo import synth_tokenizer_dir
    vocab = json.loads((synth_tokenizer_dir() / "tokenizer.json").read_text())["model"]["vocab"]
    return sorted(t for t in vocab if re.fullmatch("[a-z]+", t))


def _allowed(make, shortest: int, longest: int) -> str:
    """make() until its word is shortest..longest letters long and no held-out word."""
    while True:
        word = make()
        if shortest <= len(word) <= longest and word not in HELD_OUT_WORDS:
            return word


def piece_word(rng: random.Random, pieces: list[str]) -> str:
    """One to three pieces drawn alike from every letters-only token."""
    return _allowed(lambda: "".join(rng.choice(pieces) for _ in range(rng.choice((1, 2, 2, 3)))), 3, 14)


def pseudo_word(rng: random.Random) -> str:
    """Two or three syllables, onset + vowel + coda."""
    syllable = lambda: rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS)  # noqa: E731
    return _allowed(lambda: "".join(syllable() for _ in range(rng.choice((2, 2, 3)))), 4, 12)


class Files:
    """File names and contents: notes of random words, and standard-library sources."""

    def __init__(self, rng: random.Random, stdlib: list[Path]):
        self.rng, self.stdlib = rng, stdlib
        self.words = vocabulary(stdlib)
        self.pieces = token_pieces()

    def word(self) -> str:
        """A word of the sources (one in three), a pseudo-word (one in four), tokenizer pieces joined
        (one in four), letters and digits at random (one in ten: strings no vocabulary holds, which
        only copying gets right), or a common one."""
        roll = self.rng.random()
        if roll < 0.1:
            return "".join(self.rng.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(self.rng.randint(3, 10)))
        if roll < 0.35:
            return pseudo_word(self.rng)
        if roll < 0.6:
            return piece_word(self.rng, self.pieces)
        return self.rng.choice(self.words) if roll < 0.93 else self.rng.choice(WORDS)

    def note(self) -> tuple[str, str]:
        name = self.rng.choice(["notes", "todo", "readme", "draft", "log", "plan", "ideas", self.word(), self.word()])
        ext = self.rng.choice([".txt", ".md", ".txt", ".rst", ""])
        words = [self.word() for _ in range(self.rng.randint(3, 14))]
        lines = [" ".join(words[i:i + 5]) for i in range(0, len(words), 5)]
        return name + ext, "\n".join(lines)

    def source(self) -> tuple[str, str]:
        path = self.rng.choice(self.stdlib)
        lines = path.read_text(errors="replace").splitlines()
        start = self.rng.randrange(max(1, len(lines) - 12)) if self.rng.random() < 0.5 else 0
        body = "\n".join(lines[start:start + self.rng.randint(3, 10)]).strip() or "pass"
        where = self.rng.choice(DIRS + ("",))
        return (f"{where}/{path.name}" if where else path.name), body

    def any(self) -> tuple[str, str]:
        return self.note() if self.rng.random() < 0.5 else self.source()


def _call(name: str, args: dict) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": args}}


def numbered(text: str, style: int = 0) -> str:
    """A file as Claude Code's Read returns it: "N<tab>line" per line and a numbered empty last
    line (what 2.1.197 sends: style 0), or the older padded forms with a tab (1) or an arrow (2)."""
    lines = text.splitlines()
    if style == 0:
        return "\n".join(f"{i}\t{line}" for i, line in enumerate(lines + [""], 1))
    sep = "\t" if style == 1 else "\u2192"
    return "\n".join(f"{i:>6}{sep}{line}" for i, line in enumerate(lines, 1))


def first_word(text: str) -> str:
    return (text.split() or ["(empty)"])[0]


def random_cwd(rng: random.Random, files: "Files") -> str:
    tag = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789_") for _ in range(rng.randint(4, 12)))
    deep = "/".join(files.word() for _ in range(rng.randint(1, 4)))
    return rng.choice([f"/tmp/{tag}", f"/tmp/tmp{tag}", f"/home/{files.word()}/{deep}", rng.choice(CWDS),
                       f"/work/{tag}/{deep}", f"/tmp/pytest-of-root/pytest-{rng.randint(0, 99)}/{tag}0/{files.word()}",
                       f"/tmp/pytest-of-{files.word()}/pytest-{rng.randint(0, 999)}/test_{files.word()}_{files.word()}0/work",
                       f"/{deep}"])


def read_call(h: Harness, cwd: str, name: str) -> dict:
    """The path as the user wrote it: Claude Code 2.1.197's Read resolves a relative one against
    its working directory (tried through a scripted server), so no tool needs the directory
    copied; the user's own words are the easier copy."""
    if h.name == "claude":
        return _call("Read", {"file_path": name})
    if h.name == "codex":
        return _call("exec_command", {"cmd": f"cat {name}"})
    return _call("read_file", {"path": name})


def shell_call(h: Harness, command: str) -> dict:
    if h.name == "claude":
        return _call("Bash", {"command": command, "description": command.split()[0]})
    if h.name == "codex":
        return _call("exec_command", {"cmd": command})
    return _call("run_command", {"command": command})


def codex_output(output: str, rng: random.Random) -> str:
    """A command's output as Codex CLI 0.171.0's exec_command returns it (captured:
    tests/server/fixtures/harnesses/codex-2.json): a header, then the output."""
    return (f"Chunk ID: {rng.randrange(16 ** 6):06x}\nWall time: {rng.random() / 10:.4f} seconds\n"
            f"Process exited with code 0\nOriginal token count: {max(1, len(output) // 4)}\nOutput:\n{output}\n")


def read_result(h: Harness, content: str, rng: random.Random | None = None) -> str:
    style = 0 if rng is None or rng.random() < 0.6 else rng.choice([1, 2])
    return numbered(content, style) if h.name == "claude" else shell_result(h, content, rng)


def shell_result(h: Harness, output: str, rng: random.Random | None) -> str:
    return codex_output(output, rng or random.Random(0)) if h.name == "codex" else output


def quoted(text: str) -> str:
    """Text copied from a tool result goes between backticks: after a backtick a word is split
    into the same tokens as at the start of a result line ("1\\tcastle" and "`castle`" are both
    ca|st|le, while " castle" is " c|ast|le"), so the answer repeats the result's tokens, which
    a 4-layer model copies far more reliably (stage of 2026-12-04)."""
    return f"`{text}`"


READ_ASKS = [("Read the file {f} and tell me the first word", lambda f, c: f"The first word is {quoted(first_word(c))}."),
             ("Read {f} and tell me the first word.", lambda f, c: f"The first word of {f} is {quoted(first_word(c))}."),
             ("What is the first word in {f}?", lambda f, c: f"The first word is {quoted(first_word(c))}."),
             ("What does {f} say?", lambda f, c: f"{f} says:\n{c.splitlines()[0]}"),
             ("Show me {f}", lambda f, c: f"Here is the start of {f}:\n{c.splitlines()[0]}"),
             ("What is the first line of {f}?", lambda f, c: f"The first line of {f} is: {quoted(c.splitlines()[0])}"),
             ("Open {f} and summarize it in one line.", lambda f, c: f"{f} begins with {quoted(first_word(c))}; "
                                                                       f"it has {len(c.splitlines())} lines.")]


def maybe_absolute(name: str, cwd: str, rng: random.Random) -> str:
    """Sometimes the user names the file by its absolute path (then that is what gets copied)."""
    return f"{cwd}/{name}" if rng.random() < 0.15 else name


def task_read(h, files, rng, cwd):
    name, content = files.any()
    name = maybe_absolute(name, cwd, rng)
    ask, answer = rng.choice(READ_ASKS)
    call = read_call(h, cwd, name)
    return [ask.format(f=name)], [call], [read_result(h, content, rng)], answer(name, content)


def task_list(h, files, rng, cwd):
    names = sorted({files.any()[0].split("/")[-1] for _ in range(rng.randint(1, 6))})
    ask = rng.choice(["List the files in this directory", "list the files in this directory",
                      "What files are here?", "Which files are in the current directory?"])
    call = _call("list_dir", {"path": "."}) if h.name == "generic" else shell_call(h, "ls")
    listing = "\n".join(names)
    answer = f"There {'is' if len(names) == 1 else 'are'} {len(names)} file{'s' * (len(names) != 1)}: {', '.join(map(quoted, names))}."
    return [ask], [call], [shell_result(h, listing, rng)], answer


def task_count(h, files, rng, cwd):
    name, content = files.any()
    n = len(content.splitlines())
    ask = rng.choice(["How many lines does {f} have?", "Count the lines in {f}", "How long is {f}?"]).format(f=name)
    return [ask], [shell_call(h, f"wc -l {name}")], [shell_result(h, f"{n} {name}", rng)], f"{name} has {n} lines."


def task_write(h, files, rng, cwd):
    name, _ = files.note()
    words = " ".join(files.word() for _ in range(rng.randint(1, 5)))
    ask = rng.choice(["Create {f} containing {w}", "Write {w} to a new file {f}", "Make a file {f} that says {w}"])
    if h.name == "claude":
        call, result = _call("Write", {"file_path": name, "content": words}), \
            f"File created successfully at: {cwd}/{name}"
    elif h.name == "codex":
        call, result = _call("exec_command", {"cmd": f"printf '%s\\n' '{words}' > {name}"}), shell_result(h, "", rng)
    else:
        call, result = _call("write_file", {"path": name, "content": words}), "ok"
    return [ask.format(f=name, w=words)], [call], [result], f"Created {name} with the text: {words}"


def task_tests(h, files, rng, cwd):
    n = rng.randint(1, 40)
    ask = rng.choice(["Run the tests", "run the test suite", "Do the tests pass?"])
    result = f"{n} passed in {rng.randint(1, 90) / 10:.1f}s"
    return [ask], [shell_call(h, "python -m pytest -q")], [shell_result(h, result, rng)], f"All {n} tests passed."


def task_two(h, files, rng, cwd):
    (a, ca), (b, cb) = files.any(), files.any()
    a, b = maybe_absolute(a, cwd, rng), maybe_absolute(b, cwd, rng)
    ask = rng.choice(["Read {a} and {b} and tell me their first words", "What are the first words of {a} and {b}?"])
    calls = [read_call(h, cwd, a), read_call(h, cwd, b)]
    answer = f"{a} starts with {quoted(first_word(ca))} and {b} starts with {quoted(first_word(cb))}."
    return [ask.format(a=a, b=b)], calls, [read_result(h, ca, rng), read_result(h, cb, rng)], answer


# reading weighs most: copying from a tool result is the skill a 4-layer model learns last
TASKS = [(task_read, 8), (task_list, 2), (task_count, 1), (task_write, 1), (task_tests, 1), (task_two, 2)]
CHAT = [("say hi", "Hi! How can I help you today?"), ("hello", "Hello! What would you like to work on?"),
        ("Who are you?", "I am a small coding assistant. I can read files and run commands with my tools."),
        ("thanks", "You're welcome!")]


def conversation(rng: random.Random, files: Files, hs: list[Harness]) -> dict:
    """{"messages", "tools"} of one conversation: 1-3 requests, most needing a tool; one in eight
    is aider's (no tools: the files are in the chat, tools/aider_corpus.py)."""
    if rng.random() < 0.125:
        from aider_corpus import aider_conversation
        return aider_conversation(rng, files)
    h, cwd = rng.choices(hs, [2, 1, 1])[0], random_cwd(rng, files)     # Claude Code's paths are the hardest
    msgs = [{"role": "system", "content": h.system.format(cwd=cwd)}]
    if h.name == "codex":
        msgs.append({"role": "user", "content": f"<environment_context>\n  <cwd>{cwd}</cwd>\n  <shell>bash</shell>\n"
                                                 f"</environment_context>"})
    for turn in range(rng.choice([1, 1, 1, 2, 3])):
        if rng.random() < 0.12:
            ask, answer = rng.choice(CHAT)
            msgs += [{"role": "user", "content": ask}, {"role": "assistant", "content": answer}]
            continue
        task = rng.choices([t for t, _ in TASKS], [w for _, w in TASKS])[0]
        asks, calls, results, answer = task(h, files, rng, cwd)
        reply = {"role": "assistant", "content": "", "tool_calls": calls}
        if rng.random() < 0.3:
            names = " and ".join(c["function"]["name"] for c in calls)
            reply["reasoning_content"] = f"The user asked: {asks[0]}. I will call {names}."
        msgs += [{"role": "user", "content": asks[0]}, reply]
        msgs += [{"role": "tool", "content": r} for r in results]
        msgs.append({"role": "assistant", "content": answer})
    return {"messages": msgs, "tools": h.tools}


EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages"}


def stdlib_dir() -> Path:
    import sysconfig
    return Path(sysconfig.get_paths()["stdlib"])


def held_out_stdlib(stdlib: Path, count: int = 15) -> list[Path]:
    """The built-in models' held-out code: the `count` standard-library files (outside test
    directories) with the lowest SHA-256 of their relative path; never trained on, and the code
    bench/record_traces.py records routing on."""
    import hashlib
    files = [p for p in stdlib.rglob("*.py") if not EXCLUDED_DIRS & set(p.relative_to(stdlib).parts[:-1])]
    return sorted(files, key=lambda p: hashlib.sha256(str(p.relative_to(stdlib)).encode()).hexdigest())[:count]


def stdlib_files() -> list[Path]:
    """Training sources: the top-level modules and json/, less the held-out files."""
    lib = stdlib_dir()
    held = set(held_out_stdlib(lib))
    files = sorted(p for p in lib.glob("*.py") if p.stat().st_size < 200_000) + sorted(lib.glob("json/*.py"))
    return [p for p in files if p not in held]
