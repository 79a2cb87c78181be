"""OpenAI Responses: the official ranges and required fields (API reference, responses/create).

This deployment keeps no response state, so `previous_response_id` (and `conversation`) is a 400
rather than being silently ignored.
"""

from __future__ import annotations

from ..errors import api_error
from . import fields as f

API = "responses"


def validate(body: dict, limits) -> None:
    for stateful in ("previous_response_id", "conversation"):
        if body.get(stateful) is not None:
            raise api_error(API, 400, f"'{stateful}' is not supported: this deployment stores no responses; "
                                      "send the whole conversation in 'input'.", param=stateful,
                            code="unsupported_parameter")
    f.required(API, body, "input")
    inp = body["input"]
    if not isinstance(inp, (str, list)):
        raise f.bad(API, "input", f"expected a string or an array, but got {type(inp).__name__} instead.")
    f.max_items(API, body, "input", limits.max_messages, "items")
    f.number(API, body, "temperature", 0, 2)
    f.number(API, body, "top_p", 0, 1)
    f.number(API, body, "top_logprobs", 0, 20, integer=True)
    f.tokens(API, body, "max_output_tokens", limits)
    f.default_tokens(body, "max_output_tokens", limits)
    f.of_type(API, body, "stream", (bool,), "a boolean")
    f.of_type(API, body, "user", (str,), "a string")
    f.of_type(API, body, "instructions", (str,), "a string")
    f.of_type(API, body, "metadata", (dict,), "an object")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise f.bad(API, "tools", f"expected an array, but got {type(tools).__name__} instead.")
    f.max_items(API, body, "tools", limits.max_tools)
    if body.get("tool_choice") == "required" and not tools:
        raise api_error(API, 400, "Tool choice 'required' must be specified with 'tools' parameter.",
                        param="tool_choice", code="invalid_value")
