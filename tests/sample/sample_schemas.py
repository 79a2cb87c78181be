"""Ten JSON schemas for structured-output tests: nested objects, arrays, enums, bounded numbers,
required fields. Strings and arrays are bounded so that a random-weight model (near-uniform over
the allowed tokens) finishes in a few hundred tokens; a real model ends them on its own."""

S = {"type": "string", "maxLength": 8}

SCHEMAS = [
    {"type": "object", "properties": {"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 150}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
     "required": ["color", "ok"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                               "minItems": 1, "maxItems": 4}}, "required": ["tags"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 9999}, "email": S},
        "required": ["id", "email"], "additionalProperties": False}}, "required": ["user"], "additionalProperties": False},
    {"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 1},
                                      "level": {"type": "integer", "minimum": -5, "maximum": 5}},
     "required": ["score", "level"], "additionalProperties": False},
    {"type": "object", "properties": {"points": {"type": "array", "maxItems": 3, "items": {
        "type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 99},
                                         "y": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["x", "y"], "additionalProperties": False}}}, "required": ["points"], "additionalProperties": False},
    {"type": "object", "properties": {"status": {"const": "done"}, "code": {"enum": [200, 404, 500]},
                                      "note": {"anyOf": [S, {"type": "null"}]}},
     "required": ["status", "code", "note"], "additionalProperties": False},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
        "c": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 5}},
        "required": ["c"], "additionalProperties": False}}, "required": ["b"], "additionalProperties": False}},
     "required": ["a"], "additionalProperties": False},
    {"type": "array", "items": {"type": "object", "properties": {"k": {"enum": ["x", "y"]}, "v": {"type": "boolean"}},
                                "required": ["k", "v"], "additionalProperties": False}, "minItems": 2, "maxItems": 3},
    {"type": "object", "properties": {"title": {"type": "string", "minLength": 2, "maxLength": 6},
                                      "priority": {"type": "integer", "minimum": 1, "maximum": 3},
                                      "done": {"type": "boolean"}, "owner": {"enum": ["ann", "bob", None]}},
     "required": ["title", "priority", "done", "owner"], "additionalProperties": False},
]
