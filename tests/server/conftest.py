"""Server test fixtures: the demo tokenizer and a scripted-core server shared per module."""
from __future__ import annotations

import pytest
from fake_core import FakeCore
from server_helpers import ServerThread

from freetoken.demo import packaged_demo_dir


@pytest.fixture(scope="session")
def demo_tokenizer():
    from freetoken.tokenizer import Tokenizer
    return Tokenizer.from_dir(packaged_demo_dir())


@pytest.fixture(scope="module")
def fake_server(demo_tokenizer):
    server = ServerThread(lambda: FakeCore(demo_tokenizer)).start()
    yield server
    server.stop()
