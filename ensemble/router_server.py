"""The router in front of N replicas' gateways: one HTTP address for the three APIs, each request
proxied (streaming passes through) to the replica ensemble/router.py picks.

    python -m deepinfer.ensemble.router_server --replica http://node1:9000,http://node1:8002/metrics \
        --replica http://node2:9000,http://node2:8002/metrics --port 8080 --policy prefix

Per replica: its gateway URL and its Triton metrics URL (deepinfer_* gauges; optional). Every
`--poll-s` the router GETs each gateway's /health and metrics: a replica failing `max_failures`
checks in a row gets no new requests until a check passes. A request whose replica cannot be
reached (refused, reset before any byte) is retried once on another replica; once bytes have
gone to the client it cannot be. A client that disconnects closes the upstream request, and that
replica's gateway stops the engine request (its own disconnect handling): cancellation reaches
whichever replica holds the request.

Routing key: the request's text in prompt order (system / instructions first, then the messages'
contents), so conversations that share a system prompt share a key prefix.

Prefill/decode disaggregation (`--prefill-replica`, replicas started with kv_role="prefill"; the
`--replica`s then run kv_role="decode"):

    client --POST--> router --same body, stream=false--> prefill replica (prefix-aware pick)
                            <--its answer + x-kv-transfer-params header (the hand-over)
                     router --body + that header--> decode replica (least loaded)
           <--stream----------------------------------  (its stream, passed through as above)

The prefill runs the prompt and samples the first token, then holds the request's caches; the
decode pulls them through NIXL and streams from that token on. A prefill's error answer (400...)
goes to the client as it is; a prefill that cannot be reached or answers 503 is retried once on
another. A decode whose pull fails for a transient reason (the prefill's agent unreachable, a READ
in error, the deadline passed: its 500 names TRANSIENT_PULL_FAILURE) before any token gets the whole
hand-over once more through another healthy prefill replica, the first one counted as failed; other
pull failures (blocks gone) and a second failure answer the API's error (its gateway); the prefill frees what it holds when the decode reads it, when a decode that gave
up tells it so, or at its kv_transfer_timeout_s. A client gone during the prefill closes that
request (its gateway stops it); gone during the decode, the decode's gateway stops its request and
the decode tells the prefill to free. A replica's own x-kv-transfer-params header from a client
is dropped: only the router hands over.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging

import aiohttp
from aiohttp import web

from deepinfer.disagg.params import TRANSIENT_PULL_FAILURE

from .gateway import KV_TRANSFER_HEADER, SSE_END, sse_error
from .gateway_guard import ROUTES, error_body
from .router import ReplicaLoad, Router, parse_metrics

log = logging.getLogger("deepinfer.router")
API_PATHS = ("/v1/chat/completions", "/v1/responses", "/v1/messages")
_HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "content-encoding"}
_MAX_HEADER = 65536     # a hand-over header names every block of the prompt (aiohttp's default: 8 KiB)


def routing_key(body: bytes) -> str:
    """The text of a request in prompt order; the raw body when it is not JSON we know."""
    try:
        req = json.loads(body)
    except ValueError:
        return body.decode(errors="replace")
    if not isinstance(req, dict):
        return body.decode(errors="replace")
    parts = [_text(req.get("system")), _text(req.get("instructions"))]
    items = req.get("messages") if isinstance(req.get("messages"), list) else req.get("input")
    if isinstance(items, list):
        parts += [_text(m.get("content")) if isinstance(m, dict) else _text(m) for m in items]
    else:
        parts.append(_text(items))
    return "\x1e".join(p for p in parts if p)


def _text(v) -> str:
    if v is None:
        return ""
    if isinstance(v, str):
        return v
    if isinstance(v, list):
        return "".join(_text(x.get("text") if isinstance(x, dict) else x) for x in v)
    return json.dumps(v, sort_keys=True)


class RouterServer:
    def __init__(self, replicas: dict[str, str | None], policy: str = "prefix", poll_s: float = 1.0,
                 chunk: int = 256, prefill: dict[str, str | None] | None = None) -> None:
        """replicas: gateway URL -> Triton metrics URL (or None); prefill: the same for prefill
        replicas (then `replicas` are the decode ones: least loaded, the prefix lives on the prefill)."""
        self.metrics_urls = {**(prefill or {}), **replicas}
        self.router = Router(list(replicas), policy="least_loaded" if prefill else policy, chunk=chunk)
        self.prefill_router = Router(list(prefill), policy=policy, chunk=chunk) if prefill else None
        self.poll_s = poll_s
        self.session: aiohttp.ClientSession | None = None
        self._poller: asyncio.Task | None = None

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        for path in API_PATHS:
            app.router.add_post(path, self.proxy)
        app.router.add_get("/v1/models", self.proxy)
        app.router.add_get("/health", self.health)
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)
        return app

    async def _open(self, _app) -> None:
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=5),
                                             max_field_size=_MAX_HEADER)
        await self.check_all()
        self._poller = asyncio.create_task(self._poll())

    async def _close(self, _app) -> None:
        if self._poller is not None:
            self._poller.cancel()
        await self.session.close()

    # health and load ------------------------------------------------------------------------------
    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            await self.check_all()

    async def check_all(self) -> None:
        await asyncio.gather(*(self._check(name) for name in self.metrics_urls))

    async def _check(self, name: str) -> None:
        quick = aiohttp.ClientTimeout(total=3)
        try:
            async with self.session.get(f"{name}/health", timeout=quick) as r:
                healthy = r.status == 200
            load = ReplicaLoad()
            url = self.metrics_urls[name]
            if healthy and url:
                async with self.session.get(url, timeout=quick) as r:
                    load = parse_metrics(await r.text())
            load.healthy = healthy
        except (aiohttp.ClientError, asyncio.TimeoutError):
            load = ReplicaLoad(healthy=False)
        self._router_of(name).update_load(name, load)

    def _router_of(self, name: str) -> Router:
        return self.router if name in self.router.replicas else self.prefill_router

    async def health(self, _request: web.Request) -> web.Response:
        live = self.router.healthy()
        body = {"healthy_replicas": live}
        if self.prefill_router is not None:
            body["healthy_prefill_replicas"] = self.prefill_router.healthy()
            live = live and body["healthy_prefill_replicas"]
        return web.json_response(body, status=200 if live else 503)

    # requests -----------------------------------------------------------------------------------
    async def proxy(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        key = routing_key(body) if request.method == "POST" else ""
        if self.prefill_router is None or request.method != "POST":
            return await self._decode(request, body, key)
        prefills: list[str] = []
        while True:
            handover = await self._prefill(request, body, key, exclude=prefills)
            if isinstance(handover, web.Response):
                return handover                              # the prefill's own answer (an error)
            name, handover = handover
            prefills.append(name)
            # the whole hand-over once more on another prefill replica when the pull failed for a
            # transient reason (the client has seen nothing yet); else the decode's answer as it is
            retry = len(prefills) < 2 and any(n not in prefills for n in self.prefill_router.healthy())
            try:
                return await self._decode(request, body, key, handover, retry)
            except _PullFailed as e:
                log.warning("the decode's pull from prefill replica %s failed (%s); the hand-over again elsewhere",
                            name, e)
                self.prefill_router.report_failure(name)

    async def _decode(self, request: web.Request, body: bytes, key: str, handover: str | None = None,
                      retry_pull: bool = False) -> web.StreamResponse:
        tried: list[str] = []
        for _ in range(2):                                   # one retry on another replica
            try:
                name = self.router.pick(key, exclude=tried)
            except LookupError:
                break
            tried.append(name)
            try:
                return await self._forward(request, name, body, handover, retry_pull)
            except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as e:
                log.warning("replica %s failed before answering (%s); %s", name, e,
                            "retrying elsewhere" if len(tried) < 2 else "giving up")
                self.router.report_failure(name)
        return _error(request, 503, f"no replica could take the request (tried {tried})")

    async def _prefill(self, request: web.Request, body: bytes, key: str,
                       exclude: list[str]) -> tuple[str, str] | web.Response:
        """The request on a prefill replica (none of `exclude`), not streamed -> (that replica, its
        hand-over: the header's JSON), or the response the client gets instead (the prefill's error
        answer, or ours)."""
        try:
            req = json.loads(body)
        except ValueError:
            req = None
        if not isinstance(req, dict):                        # the API's 400 comes from the prefill's gateway
            req = None
        # whole, not streamed: the router only needs its hand-over (stream_options goes with stream)
        data = body if req is None else json.dumps(
            {**{k: v for k, v in req.items() if k != "stream_options"}, "stream": False}).encode()
        headers = self._headers(request)
        tried: list[str] = []
        for _ in range(2):
            try:
                name = self.prefill_router.pick(key, exclude=tried + exclude)
            except LookupError:
                break
            tried.append(name)
            try:
                async with self.session.post(f"{name}{request.path_qs}", data=data, headers=headers) as r:
                    answer, status, handover = await r.read(), r.status, r.headers.get(KV_TRANSFER_HEADER)
            except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as e:
                log.warning("prefill replica %s failed (%s)", name, e)
                self.prefill_router.report_failure(name)
                continue
            finally:
                self.prefill_router.done(name)
            if status == 503:                                # its engine is not answering: another one
                self.prefill_router.report_failure(name)
                continue
            if status != 200:
                return web.Response(status=status, body=answer, content_type="application/json")
            if not handover:
                return _error(request, 502, f"prefill replica {name} answered without a hand-over "
                                            "(is it running kv_role='prefill'?)")
            return name, handover
        return _error(request, 503, f"no prefill replica could take the request (tried {exclude + tried})")

    @staticmethod
    def _headers(request: web.Request) -> dict:
        drop = _HOP_HEADERS | {"host", KV_TRANSFER_HEADER}
        return {k: v for k, v in request.headers.items() if k.lower() not in drop}

    async def _forward(self, request: web.Request, name: str, body: bytes, handover: str | None = None,
                       retry_pull: bool = False) -> web.StreamResponse:
        headers = self._headers(request)
        if handover is not None:
            headers[KV_TRANSFER_HEADER] = handover
        try:
            async with self.session.request(request.method, f"{name}{request.path_qs}", data=body,
                                            headers=headers) as up:
                response = web.StreamResponse(status=up.status, headers={
                    k: v for k, v in up.headers.items() if k.lower() not in _HOP_HEADERS})
                first = await up.content.readany()           # before this, a failure can still be retried
                if retry_pull and up.status == 500 and TRANSIENT_PULL_FAILURE.encode() in first:
                    raise _PullFailed(first[:500].decode(errors="replace"))
                await response.prepare(request)
                try:
                    while first:
                        await response.write(first)
                        try:
                            first = await up.content.readany()
                        except aiohttp.ClientError as e:     # the replica went away mid-stream
                            await self._end_broken_stream(request, up, response, name, e)
                            return response
                    await response.write_eof()
                except (aiohttp.ClientError, ConnectionResetError):
                    pass                                     # the client went away: closing `up` stops the replica's request
                return response
        finally:
            self.router.done(name)

    async def _end_broken_stream(self, request, up, response, name, exc) -> None:
        """The API's error event and end marker: every stream ends, even when its replica died."""
        self.router.report_failure(name)
        api = ROUTES.get(request.path)
        log.warning("replica %s broke a stream (%s)", name, exc)
        if api and up.headers.get("Content-Type", "").startswith("text/event-stream"):
            await response.write(sse_error(api, f"the replica serving this request went away: {exc}") + SSE_END[api])
        await response.write_eof()


class _PullFailed(Exception):
    """A decode replica could not pull a hand-over's caches (a transient failure, before any token)."""


def _error(request: web.Request, status: int, message: str) -> web.Response:
    """The router's own error, in the API's format."""
    api = ROUTES.get(request.path, "chat.completions")
    return web.Response(status=status, body=error_body(api, status, message).encode(), content_type="application/json")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Route the three APIs over several replicas' gateways.")
    ap.add_argument("--replica", action="append", required=True,
                    help="GATEWAY_URL[,METRICS_URL], e.g. http://127.0.0.1:9000,http://127.0.0.1:8002/metrics")
    ap.add_argument("--prefill-replica", action="append", default=[],
                    help="GATEWAY_URL[,METRICS_URL] of a kv_role='prefill' replica (then the --replica ones decode)")
    ap.add_argument("--policy", default="prefix", choices=Router.POLICIES)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8080)
    ap.add_argument("--poll-s", type=float, default=1.0)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    server = RouterServer(_specs(args.replica), args.policy, args.poll_s, prefill=_specs(args.prefill_replica) or None)
    # handler_cancellation: a client gone while the router waits (the prefill, the decode's first
    # byte) cancels the handler, which closes the upstream request (its gateway stops the engine)
    web.run_app(server.app(), host=args.host, port=args.port, handler_cancellation=True)
    return 0


def _specs(items: list[str]) -> dict[str, str | None]:
    out = {}
    for spec in items:
        gw, _, metrics = spec.partition(",")
        out[gw.rstrip("/")] = metrics or None
    return out


if __name__ == "__main__":
    raise SystemExit(main())
