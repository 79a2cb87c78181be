"""Error bodies in each API's own format, and the one exception the pre- and postprocess raise.

Chat Completions and Responses answer with OpenAI's `{"error": {message, type, param, code}}` (the
body deepseek-recipe's `ConversionError.body` already carries); Anthropic Messages answers with
`{"type": "error", "error": {"type", "message"}}`.
"""

from __future__ import annotations

import json

# HTTP status -> Anthropic error type (docs.anthropic.com "Errors").
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    500: "api_error", 503: "overloaded_error"}
_OPENAI_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
                 413: "invalid_request_error", 500: "server_error", 503: "server_error"}


class RecipeError(Exception):
    """A request the API rejects: `status` is the HTTP status, `body` the API's error JSON."""

    def __init__(self, status: int, body: str):
        super().__init__(body)
        self.status = status
        self.body = body


def error_body(api: str, status: int, message: str, code: str | None = None, param: str | None = None) -> str:
    if api == "messages":
        err_type = _ANTHROPIC_TYPES.get(status, "api_error")
        return json.dumps({"type": "error", "error": {"type": err_type, "message": message}})
    err_type = _OPENAI_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return json.dumps({"error": {"message": message, "type": err_type, "param": param,
                                 "code": code or err_type}})


def api_error(api: str, status: int, message: str, code: str | None = None, param: str | None = None) -> RecipeError:
    return RecipeError(status, error_body(api, status, message, code, param))


def from_conversion_error(api: str, exc: Exception) -> RecipeError:
    """deepseek-recipe's ConversionError carries an OpenAI body; re-wrap it for Messages."""
    status = int(getattr(exc, "status_code", 400) or 400)
    body = getattr(exc, "body", None) or error_body(api, status, str(exc))
    if api == "messages":
        try:
            message = json.loads(body)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = str(exc)
        body = error_body(api, status, message)
    return RecipeError(status, body)
