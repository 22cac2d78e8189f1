"""Server test fixtures: the demo tokenizer, a scripted-core server and a demo-model server per module."""
from __future__ import annotations

import pytest
from fake_core import FakeCore
from server_helpers import ServerProcess, ServerThread

from freetoken.models.demo import packaged_demo_dir


@pytest.fixture(scope="session")
def demo_tokenizer():
    """The demo vocabulary with the Qwen3-style template that renders every message and tool
    schema whole (the synth tokenizer): what the rendering tests of the fake cores check. The
    demo model's own compact agent template: tests/server/test_agent_template.py."""
    from freetoken.models.demo import synth_tokenizer_dir
    from freetoken.tokenizer import Tokenizer
    return Tokenizer.from_dir(synth_tokenizer_dir())


@pytest.fixture(scope="module")
def fake_server(demo_tokenizer):
    server = ServerThread(lambda: FakeCore(demo_tokenizer)).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def demo_server():
    """`python -m freetoken serve` on the demo model; it must stop cleanly with no error logged."""
    proc = ServerProcess("--max-running-requests", "4")
    yield proc
    log = "".join(proc.stderr_lines)
    assert proc.stop() == 0, log[-3000:]
    assert "Traceback" not in log and "ERROR" not in log, log[-3000:]


@pytest.fixture(scope="module")
def oa(demo_server):
    """The official openai client on the module's demo-model server (a module may override it)."""
    import openai
    return openai.OpenAI(base_url=demo_server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
