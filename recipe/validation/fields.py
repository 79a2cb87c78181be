"""Field checkers shared by the three APIs: each raises RecipeError with the API's own body.

OpenAI words them "Invalid 'temperature': decimal above maximum value. Expected a value <= 2, but got
3 instead." (param set); Anthropic "temperature: Input should be less than or equal to 1".
"""

from __future__ import annotations

import math

from ..errors import RecipeError, api_error

_MISSING = object()
INT64_MAX = 2**63 - 1


def bad(api: str, param: str, openai_msg: str, anthropic_msg: str | None = None, status: int = 400) -> RecipeError:
    if api == "messages":
        return api_error(api, status, f"{param}: {anthropic_msg or openai_msg}")
    return api_error(api, status, f"Invalid '{param}': {openai_msg}", param=param, code="invalid_value")


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def number(api: str, body: dict, name: str, lo: float | None = None, hi: float | None = None,
           integer: bool = False) -> None:
    v = body.get(name, _MISSING)
    if v is _MISSING or v is None:
        return
    kind = "integer" if integer else "number"
    if integer and hi is None:
        hi = INT64_MAX   # what the official APIs' 64-bit integers hold
    if not (is_int(v) if integer else is_number(v)):
        raise bad(api, name, f"expected {'an integer' if integer else 'a number'}, but got {type(v).__name__} instead.",
                  f"Input should be a valid {kind}")
    if lo is not None and v < lo:
        raise bad(api, name, f"{kind} below minimum value. Expected a value >= {lo}, but got {v} instead.",
                  f"Input should be greater than or equal to {lo}")
    if hi is not None and v > hi:
        raise bad(api, name, f"{kind} above maximum value. Expected a value <= {hi}, but got {v} instead.",
                  f"Input should be less than or equal to {hi}")


def of_type(api: str, body: dict, name: str, types: tuple, what: str) -> None:
    v = body.get(name, _MISSING)
    if v is _MISSING or v is None:
        return
    if not isinstance(v, types) or (bool not in types and isinstance(v, bool)):
        raise bad(api, name, f"expected {what}, but got {type(v).__name__} instead.", f"Input should be {what}")


def one_of(api: str, body: dict, name: str, allowed: tuple) -> None:
    v = body.get(name, _MISSING)
    if v is _MISSING or v is None:
        return
    if not isinstance(v, str) or v not in allowed:
        choices = ", ".join(repr(a) for a in allowed)
        raise bad(api, name, f"expected one of {choices}, but got {v!r} instead.", f"Input should be {choices}")


def required(api: str, body: dict, name: str) -> None:
    if body.get(name) is None:
        if api == "messages":
            raise api_error(api, 400, f"{name}: Field required")
        raise api_error(api, 400, f"Missing required parameter: '{name}'.", param=name, code="missing_required_parameter")


def max_items(api: str, body: dict, name: str, limit: int, what: str = "items") -> None:
    v = body.get(name)
    if isinstance(v, list) and len(v) > limit:
        raise bad(api, name, f"array too long. Expected an array with maximum length {limit}, but got an array "
                  f"with length {len(v)} instead.", f"List should have at most {limit} {what}")


def tokens(api: str, body: dict, name: str, limits, lo: int = 1) -> None:
    """A max-tokens field: an integer >= lo, and within the operator's cap."""
    number(api, body, name, lo=lo, integer=True)
    v = body.get(name)
    if v is not None and limits.max_tokens_cap is not None and v > limits.max_tokens_cap:
        raise bad(api, name, f"{v} is above this deployment's limit of {limits.max_tokens_cap} output tokens.",
                  f"{v} is above this deployment's limit of {limits.max_tokens_cap} output tokens")


def default_tokens(body: dict, name: str, limits) -> None:
    if body.get(name) is None and limits.default_max_tokens is not None:
        body[name] = limits.default_max_tokens
