"""The demo model's compact agent template (tools/agent_template.jinja) on the harnesses' own
first request (captured traffic): Claude Code's 24 tools (64 KB of schemas) and 5.6 KB system
prompt render to well under the model's 2048 positions, keeping what the model needs (the working
directory, one line per tool, the request) and dropping the rest."""
import json
from pathlib import Path

from freetoken.models.demo import packaged_demo_dir
from freetoken.server.anthropic_messages import anthropic_conversation
from freetoken.server.protocol import Body
from freetoken.server.system_messages import place_system
from freetoken.tokenizer import Tokenizer

CAPTURES = Path(__file__).resolve().parent / "fixtures" / "harnesses"


def rendered(tok, capture: str) -> str:
    raw = json.loads((CAPTURES / f"{capture}.json").read_text().replace("<WORKDIR>", "/tmp/work"))["body"]
    conv = anthropic_conversation(Body(raw, "body"))
    return tok.apply_chat_template(place_system(tok, conv.messages), tools=conv.template_tools,
                                   add_generation_prompt=True)


def test_claude_codes_request_renders_compactly():
    tok = Tokenizer.from_dir(packaged_demo_dir())
    text = rendered(tok, "claude-1")
    assert len(tok.encode(text)) < 1000
    assert "- Primary working directory: /tmp/work" in text and "x-anthropic-billing-header" not in text
    assert "- Read(file_path, offset?, limit?, pages?)\n" in text and text.count("\n- ") >= 24
    assert "<system-reminder>" not in text and "currentDate" not in text
    assert "Available agent types" not in text                     # the later system message
    assert text.endswith("<|im_start|>user\nlist the files in this directory<|im_end|>\n<|im_start|>assistant\n")
