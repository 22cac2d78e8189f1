"""A first request shaped like Claude Code 2.1's, written by hand from its description (issue 11):
system prompt as text blocks with cache_control, system messages inside ``messages`` (the agent and
skill lists), ``thinking: adaptive``, ``context_management`` with a clear_thinking edit,
``output_config.effort``, ``metadata.user_id``, about 25k tokens of tool definitions and
``max_tokens: 32000``, sent to ``/v1/messages?beta=true`` with the beta header.

The texts are made up (none is Claude Code's); only the shape and the sizes follow it.
"""
from __future__ import annotations

import copy

BETAS = ["claude-code-20250219", "interleaved-thinking-2025-05-14", "context-management-2025-06-27",
         "mid-conversation-system-2026-04-07", "effort-2025-11-24"]
TOOL_NAMES = ["Agent", "Bash", "Glob", "Grep", "Read", "Edit", "Write", "NotebookEdit", "WebFetch", "WebSearch",
              "TodoWrite", "TaskCreate", "TaskGet", "TaskList", "TaskOutput", "TaskStop", "TaskUpdate", "Skill",
              "SendMessage", "ExitPlanMode", "EnterWorktree", "ExitWorktree", "CronCreate", "CronList"]
ADVICE = ["Prefer this tool over a shell command when both would do, since its output is easier to read.",
          "Always give absolute paths; relative paths are resolved against a directory you may not expect.",
          "Batch independent calls in one message so that they run in parallel and save a round trip.",
          "When the output is long, it is truncated, and the truncation is marked so that you can ask again.",
          "Never use this tool to change files the user did not ask you to change.",
          "Explain in one short sentence what you are about to do before a call that changes state.",
          "If a call fails, read the error message carefully before you retry with different arguments.",
          "Quote arguments that contain spaces, and keep each call focused on one clear purpose."]


def _description(name: str, notes: int) -> str:
    lines = [f"{name}: performs the {name.lower()} operation in the user's workspace.", "", "Usage notes:"]
    for i in range(notes):
        lines.append(f"  - ({i + 1}) {ADVICE[i % len(ADVICE)]} This applies to {name} calls of kind {i}.")
    return "\n".join(lines)


def _schema(name: str, fields: int) -> dict:
    props = {f"{name.lower()}_arg_{i}": {"type": "string", "description": f"Argument {i} of {name}: "
                                         + ADVICE[(i + 3) % len(ADVICE)]} for i in range(fields)}
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "type": "object",
            "properties": props, "required": sorted(props)[:1], "additionalProperties": False}


def tools(notes: int = 15, fields: int = 5) -> list[dict]:
    out = [{"name": n, "description": _description(n, notes), "input_schema": _schema(n, fields)} for n in TOOL_NAMES]
    out[-1]["cache_control"] = {"type": "ephemeral"}
    return out


SYSTEM = [
    {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.0; cc_entrypoint=cli;"},
    {"type": "text", "text": "You are a coding agent running in the user's terminal.",
     "cache_control": {"type": "ephemeral"}},
    {"type": "text", "text": "\nYou help users with software engineering tasks.\n\n" + "\n".join(
        f"- Rule {i}: {ADVICE[i % len(ADVICE)]}" for i in range(60)), "cache_control": {"type": "ephemeral"}},
]
REMINDER = ("<system-reminder>\nAs you answer the user's questions, you can use the following context:\n"
            "# currentDate\nToday's date is 2026-12-01.\n</system-reminder>\n\n")
AGENTS = "Available agent types for the Agent tool:\n" + "\n".join(
    f"- agent-{i}: a helper for task family {i}. (Tools: *)" for i in range(8))
SKILLS = "Available skills:\n" + "\n".join(f"- skill-{i}: what skill {i} is for." for i in range(8))


def first_request(prompt: str, model: str, **overrides) -> dict:
    """The whole body: the user's prompt, then the agent and skill lists as system messages."""
    body = {
        "model": model, "max_tokens": 32000, "stream": True, "system": copy.deepcopy(SYSTEM), "tools": tools(),
        "messages": [{"role": "user", "content": [{"type": "text", "text": REMINDER},
                                                  {"type": "text", "text": prompt,
                                                   "cache_control": {"type": "ephemeral"}}]},
                     {"role": "system", "content": AGENTS},
                     {"role": "system", "content": [{"type": "text", "text": SKILLS}]}],
        "metadata": {"user_id": '{"device_id":"0001","account_uuid":"","session_id":"0000-0001"}'},
        "thinking": {"type": "adaptive"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"},
    }
    body.update(overrides)
    return body


def sdk_kwargs(body: dict) -> dict:
    """``client.beta.messages.create`` keywords for `body`: the SDK's own parameters, the rest as
    extra_body (so they travel exactly as Claude Code sends them)."""
    named = {"model", "max_tokens", "messages", "system", "tools", "metadata", "thinking", "context_management",
             "output_config", "stream"}
    kwargs = {k: v for k, v in body.items() if k in named}
    extra = {k: v for k, v in body.items() if k not in named}
    return {**kwargs, "betas": BETAS, "extra_body": extra} if extra else {**kwargs, "betas": BETAS}
