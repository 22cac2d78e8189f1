"""Eight concurrent streaming clients on the scripted core, some dropping out midway."""
from server_helpers import check_concurrent_streams


def test_eight_clients_some_aborting(fake_server):
    prompts = [[{"role": "user", "content": f"SLEEP:3 SAY:{'answer number %d ' % i * (i + 1)}"}]
               for i in range(8)]
    solo = check_concurrent_streams(fake_server.url, prompts, max_tokens=200, aborting={1, 4, 6})
    assert solo[0] == ("answer number 0 ", "stop")
    status = fake_server.engine.counters
    assert status["step_errors"] == 0
