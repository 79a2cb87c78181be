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
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging

import aiohttp
from aiohttp import web

from .router import ReplicaLoad, Router, parse_metrics

log = logging.getLogger("deepinfer.router")
API_PATHS = ("/v1/chat/completions", "/v1/responses", "/v1/messages")
_HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "content-encoding"}


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
                 chunk: int = 256) -> None:
        """replicas: gateway URL -> Triton metrics URL (or None)."""
        self.metrics_urls = dict(replicas)
        self.router = Router(list(replicas), policy=policy, chunk=chunk)
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
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=5))
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
        self.router.update_load(name, load)

    async def health(self, _request: web.Request) -> web.Response:
        live = self.router.healthy()
        return web.json_response({"healthy_replicas": live}, status=200 if live else 503)

    # requests -----------------------------------------------------------------------------------
    async def proxy(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        key = routing_key(body) if request.method == "POST" else ""
        tried: list[str] = []
        for _ in range(2):                                   # one retry on another replica
            try:
                name = self.router.pick(key, exclude=tried)
            except LookupError:
                break
            tried.append(name)
            try:
                return await self._forward(request, name, body)
            except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as e:
                log.warning("replica %s failed before answering (%s); %s", name, e,
                            "retrying elsewhere" if len(tried) < 2 else "giving up")
                self.router.report_failure(name)
        return web.json_response({"error": {"message": f"no replica could take the request (tried {tried})",
                                            "type": "server_error"}}, status=503)

    async def _forward(self, request: web.Request, name: str, body: bytes) -> web.StreamResponse:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS | {"host"}}
        try:
            async with self.session.request(request.method, f"{name}{request.path_qs}", data=body,
                                            headers=headers) as up:
                response = web.StreamResponse(status=up.status, headers={
                    k: v for k, v in up.headers.items() if k.lower() not in _HOP_HEADERS})
                first = await up.content.readany()           # before this, a failure can still be retried
                await response.prepare(request)
                try:
                    while first:
                        await response.write(first)
                        first = await up.content.readany()
                    await response.write_eof()
                except (aiohttp.ClientError, ConnectionResetError):
                    pass                                     # a side went away mid-stream: nothing to retry
                return response
        finally:
            self.router.done(name)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Route the three APIs over several replicas' gateways.")
    ap.add_argument("--replica", action="append", required=True,
                    help="GATEWAY_URL[,METRICS_URL], e.g. http://127.0.0.1:9000,http://127.0.0.1:8002/metrics")
    ap.add_argument("--policy", default="prefix", choices=Router.POLICIES)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8080)
    ap.add_argument("--poll-s", type=float, default=1.0)
    args = ap.parse_args(argv)
    replicas = {}
    for spec in args.replica:
        gw, _, metrics = spec.partition(",")
        replicas[gw.rstrip("/")] = metrics or None
    logging.basicConfig(level=logging.INFO)
    web.run_app(RouterServer(replicas, args.policy, args.poll_s).app(), host=args.host, port=args.port)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
