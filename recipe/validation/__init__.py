"""Request validation before any heavy work: each official API's ranges and required fields, and the
operator's limits, checked on the raw body before the recipe converts and tokenizes it.

    body bytes --size (413)--> depth-checked JSON (400) --model (404)--> per-API rules (400)
               --> operator limits (400) --> normalized body for the recipe (max_completion_tokens
               -> max_tokens, the deployment's default max_tokens filled in)

    limits.py     Limits: what an operator sets (max_request_bytes, max messages/tools/stops,
                  max_tokens cap and default, JSON depth); from the preprocess's `limits` parameter
    json_body.py  size and nesting-depth checks, then json.loads (no recursion on deep input)
    fields.py     the field checkers (type, range, enum) that raise RecipeError with the API's body
    chat.py       OpenAI Chat Completions      (platform.openai.com/docs/api-reference/chat/create)
    responses.py  OpenAI Responses             (platform.openai.com/docs/api-reference/responses/create)
    messages.py   Anthropic Messages           (docs.anthropic.com/en/api/messages)

Everything deepseek-recipe already rejects with the official message (unknown reasoning effort, wrong
types the recipe's parser reports, tool_choice in thinking mode) is left to the recipe.
"""

from __future__ import annotations

import json

from ..errors import RecipeError, api_error
from . import chat, messages, responses
from .json_body import parse_body
from .limits import Limits

_RULES = {"chat.completions": chat.validate, "responses": responses.validate, "messages": messages.validate}


def validate_request(api: str, raw: bytes | str, served_models, limits: Limits) -> str:
    """The body the recipe should convert (normalized), or RecipeError with the API's status and body."""
    body = parse_body(api, raw, limits)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise api_error(api, 400, "model: field required" if api == "messages" else
                        "you must provide a model parameter", param="model")
    if model not in served_models:
        raise _model_not_found(api, model)
    _RULES[api](body, limits)
    return json.dumps(body, ensure_ascii=False)


def _model_not_found(api: str, model: str) -> RecipeError:
    if api == "messages":
        return api_error(api, 404, f"model: {model}")
    return api_error(api, 404, f"The model `{model}` does not exist or you do not have access to it.",
                     code="model_not_found")


__all__ = ["Limits", "validate_request"]
