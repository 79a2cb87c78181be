"""OpenAI Chat Completions: the official ranges and required fields (API reference, chat/create)."""

from __future__ import annotations

from ..errors import api_error
from . import fields as f

API = "chat.completions"
ROLES = ("system", "developer", "user", "assistant", "tool", "function")
MAX_STOP = 4            # "Up to 4 sequences"
MAX_LOGIT_BIAS = 300    # entries; each value in [-100, 100]


def validate(body: dict, limits) -> None:
    _messages(body, limits)
    _sampling(body)
    _max_tokens(body, limits)
    _stop(body, limits)
    _tools(body, limits)
    _extras(body)


def _messages(body: dict, limits) -> None:
    f.required(API, body, "messages")
    msgs = body["messages"]
    if not isinstance(msgs, list):
        raise f.bad(API, "messages", f"expected an array, but got {type(msgs).__name__} instead.")
    if not msgs:
        raise f.bad(API, "messages", "empty array. Expected an array with minimum length 1, but got an empty array instead.")
    f.max_items(API, body, "messages", limits.max_messages, "messages")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise f.bad(API, f"messages[{i}]", f"expected an object, but got {type(m).__name__} instead.")
        if m.get("role") not in ROLES:
            raise f.bad(API, f"messages[{i}].role", f"expected one of {', '.join(map(repr, ROLES))}, "
                                                    f"but got {m.get('role')!r} instead.")


def _sampling(body: dict) -> None:
    f.number(API, body, "temperature", 0, 2)
    f.number(API, body, "top_p", 0, 1)
    f.number(API, body, "presence_penalty", -2, 2)
    f.number(API, body, "frequency_penalty", -2, 2)
    f.number(API, body, "n", 1, 1, integer=True)        # one choice per request on this deployment
    f.number(API, body, "top_logprobs", 0, 20, integer=True)
    f.number(API, body, "seed", -2**63, 2**64 - 1, integer=True)
    f.of_type(API, body, "logprobs", (bool,), "a boolean")
    f.of_type(API, body, "stream", (bool,), "a boolean")
    if body.get("top_logprobs") is not None and body.get("logprobs") is not True:
        raise f.bad(API, "top_logprobs", "top_logprobs requires logprobs to be true.")


def _max_tokens(body: dict, limits) -> None:
    """max_completion_tokens (the current name, what new SDKs send) replaces the deprecated
    max_tokens; the recipe reads only max_tokens, so it is moved there."""
    f.tokens(API, body, "max_completion_tokens", limits)
    f.tokens(API, body, "max_tokens", limits)
    if body.get("max_completion_tokens") is not None:
        body["max_tokens"] = body.pop("max_completion_tokens")
    body.pop("max_completion_tokens", None)
    f.default_tokens(body, "max_tokens", limits)


def _stop(body: dict, limits) -> None:
    stop = body.get("stop")
    if stop is None or isinstance(stop, str):
        return
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise f.bad(API, "stop", "expected a string or an array of strings.")
    f.max_items(API, body, "stop", min(MAX_STOP, limits.max_stop_sequences))


def _tools(body: dict, limits) -> None:
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise f.bad(API, "tools", f"expected an array, but got {type(tools).__name__} instead.")
    f.max_items(API, body, "tools", limits.max_tools)
    if body.get("tool_choice") == "required" and not tools:
        raise api_error(API, 400, "Invalid value for 'tool_choice': 'tool_choice' is only allowed when 'tools' "
                                  "are specified.", param="tool_choice", code="invalid_value")


def _extras(body: dict) -> None:
    f.of_type(API, body, "user", (str,), "a string")
    f.of_type(API, body, "metadata", (dict,), "an object")
    f.of_type(API, body, "parallel_tool_calls", (bool,), "a boolean")
    bias = body.get("logit_bias")
    if bias is None:
        return
    if not isinstance(bias, dict):
        raise f.bad(API, "logit_bias", f"expected an object, but got {type(bias).__name__} instead.")
    if len(bias) > MAX_LOGIT_BIAS:
        raise f.bad(API, "logit_bias", f"too many entries ({len(bias)}); the maximum is {MAX_LOGIT_BIAS}.")
    for token, value in bias.items():
        if not token.isdigit():
            raise f.bad(API, "logit_bias", f"{token!r} is not a token id.")
        if not f.is_number(value) or not -100 <= value <= 100:
            raise f.bad(API, "logit_bias", f"the bias of token {token} must be a number in [-100, 100], got {value!r}.")
