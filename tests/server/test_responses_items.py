"""Responses API input items -> neutral messages, instructions, and the response store (no server)."""
from freetoken.server.responses_items import ResponseStore, items_messages, with_instructions


def test_items_become_one_assistant_turn():
    items = [{"role": "user", "content": "q"},
             {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "think"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Looking."}]},
             {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"a": 1}'},
             {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "one"}]},
             {"type": "function_call_output", "call_id": "c2", "output": "two"},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Done."}]}]
    out = items_messages(items)
    assert [m["role"] for m in out] == ["user", "assistant", "tool", "tool", "assistant"]
    turn = out[1]
    assert turn["content"] == "Looking." and turn["reasoning_content"] == "think"
    assert [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in turn["tool_calls"]] == [
        ("c1", "f", {"a": 1}), ("c2", "g", {})]
    assert out[2] == {"role": "tool", "tool_call_id": "c1", "content": "one"} and out[4]["content"] == "Done."


def test_with_instructions_joins_leading_system_messages():
    msgs = [{"role": "system", "content": "dev"}, {"role": "user", "content": "u"},
            {"role": "system", "content": "later"}]
    assert with_instructions("base", msgs) == [{"role": "system", "content": "base\n\ndev"}, msgs[1], msgs[2]]
    assert with_instructions(None, msgs[1:]) == msgs[1:]


def test_store_is_a_bounded_lru():
    store = ResponseStore(capacity=2)
    store.put("a", [1])
    store.put("b", [2])
    assert store.get("a") == [1]            # a is now the most recent
    store.put("c", [3])
    assert store.get("b") is None and store.get("a") == [1] and store.get("c") == [3] and len(store) == 2
