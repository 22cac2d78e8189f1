"""aider's side of the agent corpus (tools/agent_corpus.py): aider sends no tools; it puts the
files the user added into the chat as *file listings* and appends its edit-format reminder to the
request (captured: tests/server/fixtures/harnesses/aider-2.json, aider 0.86.2, whole-file
format). The answer is written straight from the listing: a question gets the answer, a change
gets the file listing aider applies."""
from __future__ import annotations

import functools
import json
import random

from agent_corpus import CAPTURES, READ_ASKS

ADDED = "I have *added these files to the chat* so you can go ahead and edit them."


@functools.lru_cache(maxsize=1)
def _captured() -> tuple[list[dict], str, str]:
    """(messages before the files-added one, that message's head, the reminder after a request)."""
    messages = json.loads((CAPTURES / "aider-2.json").read_text())["body"]["messages"]
    at = next(i for i, m in enumerate(messages) if m["content"].startswith(ADDED))
    head = messages[at]["content"].split("notes.txt\n```", 1)[0]
    request = messages[-1]["content"]
    return messages[:at], head, request[request.index("\n\nTo suggest changes"):]


def listing(name: str, content: str) -> str:
    return f"{name}\n```\n{content}\n```\n"


def aider_conversation(rng: random.Random, files) -> dict:
    """{"messages", "tools": None}: the captured preamble, one to three files added, a question
    about one of them (or a new file to write), the answer from the listing."""
    before, head, reminder = _captured()
    added = [files.any() for _ in range(rng.randint(1, 3))]
    msgs = [dict(m) for m in before]
    msgs += [{"role": "user", "content": head + "".join(listing(n, c) for n, c in added)},
             {"role": "assistant", "content": "Ok, any changes I propose will be to those files."}]
    name, content = rng.choice(added)
    if rng.random() < 0.8:
        ask, answer = rng.choice(READ_ASKS)
        msgs += [{"role": "user", "content": ask.format(f=name) + reminder},
                 {"role": "assistant", "content": answer(name, content)}]
    else:
        new, _ = files.note()
        words = " ".join(files.word() for _ in range(rng.randint(1, 5)))
        msgs += [{"role": "user", "content": f"Create {new} containing {words}" + reminder},
                 {"role": "assistant", "content": f"Ok, I will create {new}.\n\n" + listing(new, words)}]
    return {"messages": msgs, "tools": None}
