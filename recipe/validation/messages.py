"""Anthropic Messages: the official ranges and required fields (docs.anthropic.com/en/api/messages)."""

from __future__ import annotations

from ..errors import api_error
from . import fields as f

API = "messages"
ROLES = ("user", "assistant")
MIN_BUDGET_TOKENS = 1024


def validate(body: dict, limits) -> None:
    f.required(API, body, "max_tokens")
    f.tokens(API, body, "max_tokens", limits)
    _messages(body, limits)
    f.number(API, body, "temperature", 0, 1)
    f.number(API, body, "top_p", 0, 1)
    f.number(API, body, "top_k", 0, integer=True)
    f.of_type(API, body, "stream", (bool,), "a valid boolean")
    f.of_type(API, body, "system", (str, list), "a valid string or list")
    _stop_sequences(body, limits)
    _thinking(body)
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise f.bad(API, "tools", "Input should be a valid list")
    f.max_items(API, body, "tools", limits.max_tools, "tools")
    meta = body.get("metadata")
    if meta is not None and (not isinstance(meta, dict) or not isinstance(meta.get("user_id", ""), (str, type(None)))):
        raise f.bad(API, "metadata", "Input should be an object with an optional string user_id")


def _messages(body: dict, limits) -> None:
    f.required(API, body, "messages")
    msgs = body["messages"]
    if not isinstance(msgs, list):
        raise f.bad(API, "messages", "Input should be a valid list")
    f.max_items(API, body, "messages", limits.max_messages, "messages")
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise f.bad(API, f"messages.{i}", "Input should be a valid dictionary")
        if m.get("role") == "system":
            raise api_error(API, 400, f"messages.{i}.role: Unexpected role \"system\". The Messages API accepts a "
                                      "top-level `system` parameter, not \"system\" as an input message role.")
        if m.get("role") not in ROLES:
            raise f.bad(API, f"messages.{i}.role", "Input should be 'user' or 'assistant'")


def _stop_sequences(body: dict, limits) -> None:
    stops = body.get("stop_sequences")
    if stops is None:
        return
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise f.bad(API, "stop_sequences", "Input should be a valid list of strings")
    f.max_items(API, body, "stop_sequences", limits.max_stop_sequences, "items")


def _thinking(body: dict) -> None:
    thinking = body.get("thinking")
    if thinking is None:
        return
    if not isinstance(thinking, dict) or thinking.get("type") not in ("enabled", "disabled", "adaptive"):
        raise f.bad(API, "thinking", "Input should be an object with type 'enabled', 'disabled' or 'adaptive'")
    if thinking["type"] != "enabled":
        return
    budget = thinking.get("budget_tokens")
    if not f.is_int(budget) or budget < MIN_BUDGET_TOKENS:
        raise f.bad(API, "thinking.enabled.budget_tokens", f"Input should be greater than or equal to {MIN_BUDGET_TOKENS}")
    if f.is_int(body.get("max_tokens")) and budget >= body["max_tokens"]:
        raise api_error(API, 400, "`max_tokens` must be greater than `thinking.budget_tokens`. Please consult our "
                                  "documentation at https://docs.claude.com/en/docs/build-with-claude/extended-thinking"
                                  "#max-tokens-and-context-window-size")
