"""The limits an operator sets on one deployment (the preprocess's `limits` parameter, JSON)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    max_request_bytes: int = 4 * 1024 * 1024   # the body, before any parsing (413 above it)
    max_json_depth: int = 64                   # nesting of objects/arrays (a 100,000-deep body is 400)
    max_messages: int = 2048                   # messages / input items per request
    max_tools: int = 128                       # OpenAI's own limit
    max_stop_sequences: int = 16               # Chat's official limit is 4 (checked in chat.py)
    max_tokens_cap: int | None = None          # a larger requested max_tokens is a 400 (None: context only)
    default_max_tokens: int | None = None      # for requests without one (None: the recipe's 8,192 /
                                               # 65,536 thinking; small deployments set less)

    @classmethod
    def from_json(cls, text: str | None) -> "Limits":
        values = json.loads(text) if text else {}
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(values) - known
        if unknown:
            raise ValueError(f"unknown limits {sorted(unknown)}; known: {sorted(known)}")
        return cls(**values)
