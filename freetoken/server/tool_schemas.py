"""A tool's parameter schema checked against its JSON Schema draft's meta-schema (jsonschema, the
field's reference validator: hand-written checks would cover a fraction of the drafts), so a
schema that is not one is a 400 naming the field, as OpenAI and Anthropic answer, rather than a
tool the model is shown and a grammar that quietly ignores it."""
from __future__ import annotations

import json

from freetoken.server.errors import APIError

_KNOWN_GOOD: dict[str, None] = {}     # canonical texts already checked: agents resend their tools each turn
_REMEMBERED = 512                     # Claude Code's 24 schemas take about 25 ms to check, a lookup 1 ms


def checked_schema(schema, param: str) -> dict:
    """``schema`` when it is a valid JSON Schema object (the draft its ``$schema`` names, else
    2020-12), else APIError(400) saying where it breaks."""
    if not isinstance(schema, dict):
        raise APIError(400, f"{param} must be a JSON Schema object", param=param)
    key = json.dumps(schema, sort_keys=True)
    if key in _KNOWN_GOOD:
        return schema
    from jsonschema import exceptions, validators
    validator = validators.validator_for(schema, default=validators.Draft202012Validator)
    try:
        validator.check_schema(schema)
    except exceptions.SchemaError as e:
        where = ".".join(str(p) for p in e.path)
        raise APIError(400, f"{param} is not a valid JSON Schema: {e.message}"
                            + (f" (at {where})" if where else ""), param=param) from None
    if len(_KNOWN_GOOD) >= _REMEMBERED:
        _KNOWN_GOOD.pop(next(iter(_KNOWN_GOOD)))
    _KNOWN_GOOD[key] = None
    return schema
