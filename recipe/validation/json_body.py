"""Body size and JSON nesting depth, checked before json.loads: Python's parser recurses per level
(a 100,000-deep body would raise RecursionError deep in the stack), so the depth is measured first on
the bracket characters outside strings."""

from __future__ import annotations

import json
import re
from itertools import accumulate

from ..errors import api_error
from .limits import Limits

_STRINGS = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKETS = re.compile(rb"[\[\]{}]")
_DEPTH_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}


def json_depth(raw: bytes) -> int:
    """The deepest nesting of objects and arrays (0 for a scalar); brackets inside strings do not count."""
    brackets = _BRACKETS.findall(_STRINGS.sub(b"", raw))
    return max(accumulate(_DEPTH_STEP[b[0]] for b in brackets), default=0)


def _no_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def parse_body(api: str, raw: bytes | str, limits: Limits) -> dict:
    data = raw.encode("utf-8", "surrogateescape") if isinstance(raw, str) else bytes(raw)
    if len(data) > limits.max_request_bytes:
        raise api_error(api, 413, f"Request body of {len(data)} bytes exceeds this deployment's limit of "
                                  f"{limits.max_request_bytes} bytes.", code="request_too_large")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise api_error(api, 400, f"The request body is not valid UTF-8 ({e.reason} at byte {e.start}).") from None
    depth = json_depth(data)
    if depth > limits.max_json_depth:
        raise api_error(api, 400, f"The request body nests objects/arrays {depth} levels deep; the limit is "
                                  f"{limits.max_json_depth}.")
    try:
        body = json.loads(text, parse_constant=_no_constant)
    except ValueError as e:
        raise api_error(api, 400, f"We could not parse the JSON body of your request: invalid JSON ({e}).") from None
    if not isinstance(body, dict):
        raise api_error(api, 400, "The request body must be a JSON object.")
    return body
