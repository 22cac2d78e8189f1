"""Constrained decoding through the CUDA backend (runner -> ops.sampling(mask=) -> mask_logits_f32):
the demo model's output parses and matches the schema, greedy and sampled."""
import json

import pytest

pytestmark = pytest.mark.gpu

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
                                           "k": {"enum": ["a", "b"]}},
          "required": ["n", "k"], "additionalProperties": False}


def test_json_schema_on_the_cuda_backend():
    from freetoken import LLM, SamplingParams
    from freetoken.grammar import json_grammar
    llm = LLM(backend="cuda")
    for temperature in (0.0, 1.0):
        out = llm.generate(["Write JSON:"], SamplingParams(max_tokens=40, temperature=temperature, seed=3,
                                                           grammar=json_grammar(SCHEMA)))[0]
        value = json.loads(out.text)
        assert set(value) == {"n", "k"} and 0 <= value["n"] <= 9 and value["k"] in ("a", "b"), out.text
