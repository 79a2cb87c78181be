"""The gateway's guard: one aiohttp middleware in front of every route.

    request --> request id --> API key (401) --> rate limits (429, gateway_limits.py) --> handler
                                                  (the handler charges the answer's tokens back)
            --> any error as the API's own JSON + x-request-id header + one log line

Every failure the client can cause ends as that API's error body: an unknown route (404) or method
(405), a body over max_request_bytes (413, read no further), a body that does not decompress or nests
too deep (400), a missing or wrong key (401), a client over its rate limits (429 + Retry-After);
anything unexpected is a 500 in the same format.
Errors aiohttp raises while parsing the HTTP message itself (a header over max_field_size) never
reach a middleware: `json_protocol_errors` re-words those as JSON too.
"""

from __future__ import annotations

import hmac
import json
import logging
import re
import time
import uuid
from dataclasses import dataclass, field
from itertools import accumulate
from pathlib import Path

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from .gateway_limits import RateLimiter, RateLimits, Refusal, estimate_tokens, retry_after_header

log = logging.getLogger("deepinfer.gateway")

ROUTES = {"/v1/chat/completions": "chat.completions", "/v1/responses": "responses", "/v1/messages": "messages"}
_ANTHROPIC_ERRORS = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                     404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                     429: "rate_limit_error", 529: "overloaded_error"}


def error_body(api: str, status: int, message: str, code: str | None = None) -> str:
    """The API's own error JSON (what the recipe writes for rejections, for the gateway's own errors)."""
    if api == "messages":
        return json.dumps({"type": "error", "error": {"type": _ANTHROPIC_ERRORS.get(status, "api_error"),
                                                      "message": message}})
    kind = "requests" if status == 429 else "invalid_request_error" if status < 500 else "server_error"
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}})


def json_response(status: int, body: str) -> web.Response:
    return web.Response(status=status, body=body.encode(), content_type="application/json")


def api_of(request) -> str:
    """The API a request speaks: its route, else Anthropic when it carries Anthropic headers."""
    api = ROUTES.get(request.path)
    if api:
        return api
    headers = request.headers
    return "messages" if "anthropic-version" in headers or "x-api-key" in headers else "chat.completions"


# -- JSON nesting depth (the same rule as deepinfer.recipe.validation.json_body; ensemble/ is a leaf
# package and does not import recipe/) ------------------------------------------------------------
_STRINGS = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKETS = re.compile(rb"[\[\]{}]")
_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}


def json_depth(raw: bytes) -> int:
    return max(accumulate(_STEP[b[0]] for b in _BRACKETS.findall(_STRINGS.sub(b"", raw))), default=0)


@dataclass
class GuardConfig:
    api_keys: frozenset = field(default_factory=frozenset)   # empty: no authentication
    max_request_bytes: int = 4 * 1024 * 1024
    max_json_depth: int = 64
    limits: RateLimits = field(default_factory=RateLimits)   # per client: its key, else its address

    @classmethod
    def from_args(cls, keys: list[str] | None, key_file: str | None, max_request_bytes: int,
                  max_json_depth: int, limits: RateLimits | None = None) -> "GuardConfig":
        all_keys = set(keys or [])
        if key_file:
            all_keys |= {line.strip() for line in Path(key_file).read_text().splitlines()
                         if line.strip() and not line.startswith("#")}
        return cls(frozenset(all_keys), max_request_bytes, max_json_depth, limits or RateLimits())


def presented_key(request) -> str:
    """OpenAI SDKs send `Authorization: Bearer <key>`, Anthropic SDKs `x-api-key: <key>`."""
    auth = request.headers.get("Authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    return request.headers.get("x-api-key", "")


def _authorized(cfg: GuardConfig, key: str) -> bool:
    return any(hmac.compare_digest(key.encode(), k.encode()) for k in cfg.api_keys)


def unauthorized(api: str, key: str) -> web.Response:
    if api == "messages":
        return json_response(401, error_body(api, 401, "invalid x-api-key"))
    shown = f"{key[:3]}...{key[-4:]}" if len(key) > 8 else "(none)" if not key else "***"
    return json_response(401, error_body(api, 401, f"Incorrect API key provided: {shown}.", "invalid_api_key"))


def rate_limited(api: str, refused: Refusal, limits: RateLimits) -> web.Response:
    retry = retry_after_header(refused.retry_after)
    if refused.in_flight:
        message = (f"Too many requests in flight for this client (limit {limits.max_in_flight}); "
                   f"retry when one of them has finished.")
    elif refused.limit == "tpm":
        message = (f"Rate limit reached for tokens per minute (TPM): limit {limits.tokens_per_minute:g}. "
                   f"Please try again in {retry}s.")
    else:
        message = (f"Rate limit reached for requests per minute (RPM): limit {limits.requests_per_minute:g}. "
                   f"Please try again in {retry}s.")
    response = json_response(429, error_body(api, 429, message, "rate_limit_exceeded"))
    response.headers["Retry-After"] = retry
    return response


OPEN_PATHS = ("/health", "/metrics")      # probes and Prometheus scrape without a key
# request keys (aiohttp's typed request storage): the guard's request id, and tokens -> None for requests under
# the limiter
REQUEST_ID = web.RequestKey("request_id", str)
CHARGE_TOKENS = web.RequestKey("charge_tokens", object)


def make_guard(cfg: GuardConfig, metrics):
    limiter = RateLimiter(cfg.limits) if cfg.limits.enabled else None

    async def limited(request: web.Request, handler, api: str) -> web.StreamResponse:
        """The handler within the client's limits (an API route only), else 429."""
        if limiter is None or request.path not in ROUTES:
            return await handler(request)
        client = presented_key(request) if cfg.api_keys else (request.remote or "")
        # under a token budget the request reserves its estimate up front (aiohttp keeps the body read here
        # for the handler)
        reserved = estimate_tokens(await request.read()) if cfg.limits.tokens_per_minute is not None else 0
        refused = limiter.admit(client, reserved)
        if refused is not None:
            return rate_limited(api, refused, cfg.limits)
        settled = []

        def charge(tokens: int) -> None:          # the answer's tokens, in place of the reservation
            if not settled:
                settled.append(tokens)
                limiter.charge(client, tokens, reserved)

        # the handler charges the answer's tokens to this client when it knows them (Gateway._answered)
        request[CHARGE_TOKENS] = charge
        try:
            return await handler(request)         # a stream's handler returns after its last byte
        finally:
            if not settled:
                limiter.refund(client, reserved)
            limiter.release(client)

    @web.middleware
    async def guard(request: web.Request, handler):
        request_id = "req_" + uuid.uuid4().hex
        request[REQUEST_ID] = request_id
        api, t0 = api_of(request), time.monotonic()
        try:
            if cfg.api_keys and request.path not in OPEN_PATHS and not _authorized(cfg, presented_key(request)):
                response = unauthorized(api, presented_key(request))
            else:
                response = await limited(request, handler, api)
        except web.HTTPException as e:   # aiohttp's own: unknown route, method, size (413)
            response = json_response(e.status, error_body(api, e.status, _reason(e, request)))
        except (HttpProcessingError, RequestPayloadError) as e:   # a body that does not decompress
            log.info("%s unreadable body: %s", request_id, e)
            response = json_response(400, error_body(api, 400, f"could not read the request body: {e}"))
            response.force_close()   # the rest of the body is unread: this connection cannot be reused
        except Exception as e:  # noqa: BLE001 - never aiohttp's plain-text 500
            log.exception("%s %s %s failed", request_id, request.method, request.path)
            response = json_response(500, error_body(api, 500, f"internal error ({type(e).__name__}); "
                                                               f"request id {request_id}"))
        if not response.prepared:
            response.headers["x-request-id"] = request_id
            response.headers["request-id"] = request_id        # what Anthropic clients read
        seconds = time.monotonic() - t0
        if request.path in ROUTES:
            metrics.request_done(api, response.status, seconds)
        log.info("%s %s %s %d %.3fs", request_id, request.method, request.path, response.status, seconds)
        return response
    return guard


def _reason(e: web.HTTPException, request) -> str:
    if e.status == 404:
        return f"Unknown request URL: {request.method} {request.path}."
    if e.status == 405:
        return f"Method {request.method} is not allowed on {request.path}."
    if e.status == 413:
        return f"Request body too large: {e.text}"
    return e.text or e.reason


async def read_body(request: web.Request, cfg: GuardConfig, api: str) -> bytes | web.Response:
    """The body, or the API's error for one too large (checked on Content-Length first: nothing is
    read) or too deeply nested."""
    if request.content_length is not None and request.content_length > cfg.max_request_bytes:
        return json_response(413, error_body(api, 413, f"Request body of {request.content_length} bytes exceeds "
                                                       f"this deployment's limit of {cfg.max_request_bytes} bytes."))
    raw = await request.read()   # aiohttp enforces client_max_size (= max_request_bytes) while reading
    depth = json_depth(raw)
    if depth > cfg.max_json_depth:
        return json_response(400, error_body(api, 400, f"The request body nests objects/arrays {depth} levels deep; "
                                                       f"the limit is {cfg.max_json_depth}."))
    return raw


def json_protocol_errors() -> None:
    """NOTE: aiohttp answers a malformed HTTP message (a header line over max_field_size, a bad
    method) from RequestHandler.handle_error in text/plain before any middleware runs; wrap it so the
    status stays and the body is the API's error JSON (by the path, when aiohttp parsed that far;
    else OpenAI's). Called once by the gateway's main()."""
    from aiohttp import web_protocol
    original = web_protocol.RequestHandler.handle_error
    if getattr(original, "_deepinfer_json", False):
        return

    def handle_error(self, request, status=500, exc=None, message=None):
        response = original(self, request, status, exc, message)
        try:
            api = api_of(request)
        except Exception:  # noqa: BLE001 - a message too broken to have a path
            api = "chat.completions"
        body = error_body(api, response.status, (exc and str(exc)) or message or response.reason)
        json_error = web.Response(status=response.status, body=body.encode(), content_type="application/json")
        json_error.force_close()
        return json_error

    handle_error._deepinfer_json = True
    web_protocol.RequestHandler.handle_error = handle_error
