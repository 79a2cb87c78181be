"""The HTTP gateway: OpenAI Chat Completions and Responses, Anthropic Messages, in front of the ensemble.

    python -m deepinfer.ensemble.gateway --triton-grpc localhost:8001 --port 9000

    POST /v1/chat/completions   POST /v1/responses   POST /v1/messages   GET /v1/models[/{id}]
    GET /health   GET /metrics (Prometheus: gateway_metrics.py)

Every request passes the guard first (gateway_guard.py: API keys, request ids in the logs and the
x-request-id header, size and JSON-depth limits, every error in the API's own JSON), and an engine
liveness probe (engine_watch.py) ends every open stream with an error if the engine process dies.

The gateway renders nothing: the postprocess already writes each chunk / event / whole response in
the request's own format, so a body goes out as the ensemble's `response` output, unchanged; the
gateway only frames it (SSE as each official API does) and turns `status` into the HTTP status.

    client --HTTP--> gateway --one gRPC stream per request, one shared channel--> deepseek_v41_flash
           <--SSE---         <--decoupled responses (chunk JSONs, status)-------

Why a stream per request on one channel (tritonclient.grpc.aio): a request's responses and its FINAL
arrive on its own stream, so nothing routes responses between requests (the sync GrpcClient runs one
request at a time per stream); HTTP/2 multiplexes the streams on one connection, so no per-request
connection setup. The gRPC call is awaited on the aiohttp loop: no thread per request.

Stopping (DESIGN.md: cancelling an ensemble request does not reach a running engine step): the
gateway chooses each request's key (the ensemble's optional `request_key` input), so when a client
disconnects (handler cancelled, or a write fails) it sends the engine's explicit stop
(`request_key` + `stop`) at once, before or after the first response, streaming or not. A stop that
reaches the engine model before its request does is kept there, and the request is answered
"abort" when it arrives (ensemble/engine_driver.py), so one stop is enough.

Prefill/decode disaggregation (the router drives it, router_server.py): the router's request to a
prefill replica comes back (not streamed) with the hand-over in the `x-kv-transfer-params` header
(the ensemble's `kv_transfer_params` output); the router sends the same request to a decode replica
with that header, which becomes the ensemble's `kv_transfer_params` input. Only the router should
set it: decode replicas are reached through the router, which drops a client's own header.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time

import grpc
from aiohttp import web

from . import contract as c
from .client import _input_tensor, decode_result
from .engine_watch import EngineDead, EngineWatch
from .gateway_guard import (CHARGE_TOKENS, REQUEST_ID, ROUTES, GuardConfig, error_body, json_protocol_errors,
                            json_response, make_guard, read_body)
from .gateway_limits import RateLimits
from .gateway_metrics import GatewayMetrics

log = logging.getLogger("deepinfer.gateway")

SERVED_MODELS = ("deepseek-flash", "DeepSeek-V4.1-Flash", "deepseek_v41_flash")   # what the preprocess accepts
KV_TRANSFER_HEADER = "x-kv-transfer-params"   # a prefill replica's hand-over (JSON), see the docstring
_ABANDON_S = 60.0                  # how long an abandoned request's stream is drained for its FINAL
PROBE_PERIOD_S = 2.0               # the engine liveness probe (EngineWatch)
PROBE_TIMEOUTS_TO_DEAD = 3         # probes in a row without an answer before the engine counts as dead
_FINISH_S = 5.0                    # how long an answered call waits for Triton to end its stream
_finishing: set[asyncio.Task] = set()   # those calls' tasks (asyncio itself keeps only weak references)


# -- each API's SSE framing --------------------------------------------------------------------------
def sse_frame(api: str, chunk: str) -> bytes:
    """Chat: `data: {...}`; Responses and Messages: `event: <type>` + `data: {...}`."""
    if api == "chat.completions":
        return f"data: {chunk}\n\n".encode()
    return f"event: {json.loads(chunk).get('type', 'message')}\ndata: {chunk}\n\n".encode()


def sse_error(api: str, message: str) -> bytes:
    """An error after the stream began (headers sent): the event each SDK raises on."""
    if api == "chat.completions":
        return sse_frame(api, error_body(api, 500, message))
    if api == "messages":
        return sse_frame(api, error_body(api, 500, message))
    return sse_frame(api, json.dumps({"type": "error", "code": "server_error", "message": message, "param": None}))


SSE_END = {"chat.completions": b"data: [DONE]\n\n", "responses": b"", "messages": b""}


def wants_stream(raw: bytes) -> bool:
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        return False   # the preprocess answers with the API's error
    return isinstance(body, dict) and body.get("stream") is True


# -- one ensemble request ---------------------------------------------------------------------------
class TritonUnavailable(RuntimeError):
    pass


class TritonStreamError(RuntimeError):
    pass


class EnsembleCall:
    """One ModelStreamInfer call for one request. A reader task pumps its responses into a queue, so
    waiting for the next one with a timeout never cancels the gRPC read."""

    def __init__(self, client, model: str, tensors: list, request_id: str, registry: set | None = None):
        self._closed = asyncio.Event()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.engine_done = False   # a finish_reason, a FINAL or an error seen: nothing runs in the engine
        self._answered = False     # Triton sent the request's last response (FINAL or its error)
        self._last_seen = False    # the caller read the response with a finish_reason (FINAL may follow)
        self._registry = registry  # the open calls the engine watch fails when the engine dies
        if registry is not None:
            registry.add(self)
        self._it = client.stream_infer(self._requests(model, tensors, request_id))
        self._reader = asyncio.ensure_future(self._read())

    def fail(self, exc: Exception) -> None:
        """End the call with an error now (the engine died: no more responses will come)."""
        self.queue.put_nowait(exc)

    async def _requests(self, model, tensors, request_id):
        yield {"model_name": model, "inputs": tensors, "request_id": request_id,
               "parameters": {"triton_enable_empty_final_response": True}}
        await self._closed.wait()   # keep our half of the stream open until the call ends

    async def _read(self) -> None:
        try:
            async for result, error in self._it:
                if error is not None:   # Triton's error response ends the request
                    self._answered = True
                    self.queue.put_nowait(TritonStreamError(str(error)))
                    return
                response = result.get_response()
                if response.outputs:
                    self.queue.put_nowait(decode_result(result))
                final = response.parameters.get("triton_final_response")
                if final is not None and final.bool_param:
                    self._answered = True
                    break
            self.queue.put_nowait(None)
        except grpc.aio.AioRpcError as e:
            kind = TritonUnavailable if e.code() == grpc.StatusCode.UNAVAILABLE else TritonStreamError
            self.queue.put_nowait(kind(f"{e.code().name}: {e.details()}"))
        except asyncio.CancelledError:
            self.queue.put_nowait(None)

    async def next(self, timeout: float | None = None) -> dict | None:
        """The next decoded response; None after FINAL. Raises TritonUnavailable/TritonStreamError."""
        item = await asyncio.wait_for(self.queue.get(), timeout)
        if item is None or isinstance(item, Exception):
            self.engine_done = True
            if isinstance(item, Exception):
                raise item
            return None
        if item.get("finish_reason"):
            self.engine_done = self._last_seen = True
        return item

    def close(self) -> None:
        if self._registry is not None:
            self._registry.discard(self)
        self._closed.set()   # our half of the stream ends (the request iterator returns)
        if self._answered or self._last_seen:   # nothing but FINAL is left: let Triton end the stream
            task = asyncio.ensure_future(self._finish())
            _finishing.add(task)
            task.add_done_callback(_finishing.discard)
        else:
            self._it.cancel()
            self._reader.cancel()

    async def _finish(self) -> None:
        """NOTE: cancelling the stream right after the request's last response (as close() did) races
        Triton 2.51 writing that response: its gRPC handler then logs "Waiting for the callback to
        retrieve cancellation" and never completes, and the stranded request keeps its model
        referenced, so at shutdown Triton never unloads the engine model and waits out its whole
        --exit-timeout-secs (30 s). So a call that saw its last response half-closes and reads on to
        Triton's end of the stream; it is cancelled only if that takes _FINISH_S."""
        try:
            await asyncio.wait_for(self._drain(), _FINISH_S)
        except (asyncio.TimeoutError, grpc.aio.AioRpcError):
            self._it.cancel()

    async def _drain(self) -> None:
        await self._reader           # up to the FINAL (a whole answer's may still be on its way)
        async for _ in self._it:     # then Triton's end of the stream
            pass


# -- the application ----------------------------------------------------------------------------------
class Gateway:
    def __init__(self, triton_grpc: str, model: str = c.ENSEMBLE, served_models=SERVED_MODELS,
                 guard: GuardConfig | None = None, probe_period_s: float = PROBE_PERIOD_S):
        self.triton_grpc, self.model, self.served_models = triton_grpc, model, tuple(served_models)
        self.guard = guard or GuardConfig()
        self.metrics = GatewayMetrics()
        self.client = None
        self._background: set[asyncio.Task] = set()
        self.watch = EngineWatch(self._probe, probe_period_s, PROBE_TIMEOUTS_TO_DEAD,
                                 lambda alive: self.metrics.set("engine_alive", float(alive)))
        self.metrics.set("engine_alive", 1.0)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.guard.max_request_bytes,
                              middlewares=[make_guard(self.guard, self.metrics)])
        for path, api in ROUTES.items():
            app.router.add_post(path, lambda request, api=api: self.handle(request, api))
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model_id}", self.model_info)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.prometheus)
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)
        return app

    async def _open(self, _app) -> None:
        import tritonclient.grpc.aio as aio
        self.client = aio.InferenceServerClient(self.triton_grpc)
        self.watch.start()

    async def _close(self, _app) -> None:
        await self.watch.stop()
        if self._background:
            await asyncio.wait(self._background, timeout=10)
        loop = asyncio.get_running_loop()
        finishing = {t for t in _finishing if t.get_loop() is loop}
        if finishing:
            await asyncio.wait(finishing, timeout=_FINISH_S)
        await self.client.close()

    # -- the three APIs ---------------------------------------------------------------------------
    async def handle(self, request: web.Request, api: str) -> web.StreamResponse:
        raw = await read_body(request, self.guard, api)
        if isinstance(raw, web.Response):
            return raw
        key = "gw-" + request[REQUEST_ID].removeprefix("req_")
        inputs = {"request": raw, "api": api, "request_key": key}
        if request.headers.get(KV_TRANSFER_HEADER):
            inputs["kv_transfer_params"] = request.headers[KV_TRANSFER_HEADER]
        call = self._call(inputs, key)
        self.metrics.add("requests_in_flight", 1)
        t0 = time.monotonic()
        try:
            first = await call.next()
            self.metrics.observe("first_chunk_seconds", time.monotonic() - t0, api=api)
            if first is None:
                return json_response(500, error_body(api, 500, "the ensemble sent no response"))
            if first["status"] != 200 or not wants_stream(raw):
                self._answered(request, api, first)
                answer = json_response(first["status"], first["response"][0])
                if first.get("kv_transfer_params_out"):    # a prefill replica's hand-over, for the router
                    answer.headers[KV_TRANSFER_HEADER] = first["kv_transfer_params_out"]
                return answer
            return await self._stream(request, api, call, first)
        except TritonUnavailable as e:
            return json_response(503, error_body(api, 503, f"Triton is unreachable at {self.triton_grpc}: {e}"))
        except (TritonStreamError, EngineDead) as e:
            return json_response(500, error_body(api, 500, str(e)))
        finally:
            self.metrics.add("requests_in_flight", -1)
            if call.engine_done:
                call.close()
            else:   # the client left (cancelled handler, failed write): stop the engine request now
                self._spawn(self._abandon(call, key))

    async def _stream(self, request: web.Request, api: str, call: EnsembleCall, first: dict) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                               "X-Accel-Buffering": "no", "x-request-id": request[REQUEST_ID]})
        await response.prepare(request)
        out, last = first, first
        try:
            while out is not None:
                if out["status"] != 200:
                    await self._stream_error(response, api, out["response"][0] if out["response"] else "error")
                    break
                last = out
                frames = b"".join(sse_frame(api, chunk) for chunk in out["response"])
                if frames:
                    await response.write(frames)
                out = await call.next()
            else:
                self._answered(request, api, last)
                await response.write(SSE_END[api])
        except (TritonUnavailable, TritonStreamError, EngineDead) as e:
            await self._stream_error(response, api, str(e))
        except ConnectionResetError:
            return response   # the client left; handle()'s finally stops the engine request
        await response.write_eof()
        return response

    async def _stream_error(self, response: web.StreamResponse, api: str, message: str) -> None:
        """The API's error event, then its end marker: a client never waits on a broken stream."""
        self.metrics.inc("stream_errors_total", api=api)
        await response.write(sse_error(api, message) + SSE_END[api])

    def _answered(self, request: web.Request, api: str, out: dict) -> None:
        """An answer's end: its tokens into the metrics and, under a token budget, onto its client."""
        if out.get("status") == 200:
            prompt, generated = int(out.get("num_input_tokens") or 0), int(out.get("num_output_tokens") or 0)
            self.metrics.answered(api, prompt, generated, out.get("finish_reason") or "")
            charge = request.get(CHARGE_TOKENS)
            if charge is not None:
                charge(prompt + generated)

    def _call(self, inputs: dict, key: str) -> EnsembleCall:
        specs = {t.name: t for t in c.ensemble_inputs()}
        tensors = [_input_tensor(_grpc_module(), specs[k], v) for k, v in inputs.items()]
        call = EnsembleCall(self.client, self.model, tensors, key, self.watch.calls)
        if not self.watch.alive:
            call.fail(EngineDead("the engine model is not answering (see the gateway's /health)"))
        return call

    # -- stopping -------------------------------------------------------------------------------------
    async def stop_engine(self, key: str, timeout: float = 10.0) -> None:
        """request_key + stop=true to the engine model (the contract's stop; FINAL only comes back)."""
        try:
            await self._engine_stop(key, timeout)
        except (asyncio.TimeoutError, TritonUnavailable, TritonStreamError) as e:
            log.warning("stop of %s: %s", key, e)

    async def _engine_stop(self, key: str, timeout: float) -> None:
        specs = {t.name: t for t in c.tensors(c.ENGINE, c.IN)}
        tensors = [_input_tensor(_grpc_module(), specs["request_key"], key),
                   _input_tensor(_grpc_module(), specs["stop"], True)]
        call = EnsembleCall(self.client, c.ENGINE, tensors, f"{key}-stop")
        try:
            while await call.next(timeout) is not None:
                pass
        finally:
            call.close()

    async def _probe(self, timeout: float) -> None:
        """The liveness probe: a stop for a key no request uses (EngineWatch)."""
        await self._engine_stop("gw-liveness-probe", timeout)

    async def _abandon(self, call: EnsembleCall, key: str) -> None:
        """Stop the request, then drain its stream until FINAL (or give up after _ABANDON_S)."""
        try:
            if self.watch.alive:
                await self.stop_engine(key)
            deadline = time.monotonic() + _ABANDON_S
            while not call.engine_done and time.monotonic() < deadline and self.watch.alive:
                try:
                    if await call.next(5.0) is None:
                        break
                except asyncio.TimeoutError:
                    continue
                except (TritonUnavailable, TritonStreamError, EngineDead):
                    break
        finally:
            call.close()

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- models, health, metrics --------------------------------------------------------------------------
    async def models(self, request: web.Request) -> web.Response:
        data = [_model_entry(m, request) for m in self.served_models]
        if "anthropic-version" in request.headers:   # the Anthropic SDK's models.list()
            return web.json_response({"data": data, "has_more": False, "first_id": data[0]["id"],
                                      "last_id": data[-1]["id"]})
        return web.json_response({"object": "list", "data": data})

    async def model_info(self, request: web.Request) -> web.Response:
        model_id = request.match_info["model_id"]
        if model_id in self.served_models:
            return web.json_response(_model_entry(model_id, request))
        if "anthropic-version" in request.headers:
            return json_response(404, error_body("messages", 404, f"model: {model_id}"))
        return json_response(404, error_body("chat.completions", 404, f"The model `{model_id}` does not exist or "
                                             "you do not have access to it.", "model_not_found"))

    async def health(self, _request: web.Request) -> web.Response:
        if not self.watch.alive:
            return web.json_response({"status": "unavailable", "error": "the engine model is not answering"},
                                     status=503)
        try:
            ready = await self.client.is_model_ready(self.model, client_timeout=5)
        except Exception as e:  # noqa: BLE001 - any failure to ask is "not ready"
            return web.json_response({"status": "unavailable", "error": str(e)}, status=503)
        return web.json_response({"status": "ready" if ready else "loading"}, status=200 if ready else 503)

    async def prometheus(self, _request: web.Request) -> web.Response:
        return web.Response(text=self.metrics.render(), content_type="text/plain")


def _model_entry(model_id: str, request: web.Request) -> dict:
    if "anthropic-version" in request.headers:
        return {"type": "model", "id": model_id, "display_name": model_id, "created_at": "2026-01-01T00:00:00Z"}
    return {"id": model_id, "object": "model", "created": 0, "owned_by": "deepseek"}


def _grpc_module():
    import tritonclient.grpc as grpcclient
    return grpcclient


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="OpenAI/Anthropic HTTP gateway in front of the Triton ensemble.")
    ap.add_argument("--triton-grpc", default="localhost:8001", help="Triton's gRPC address")
    ap.add_argument("--host", default="0.0.0.0")
    ap.add_argument("--port", type=int, default=9000)
    ap.add_argument("--model", default=c.ENSEMBLE, help="the ensemble's name in Triton")
    ap.add_argument("--api-key", action="append", default=[],
                    help="accept this key (Authorization: Bearer / x-api-key); repeatable; none = no authentication")
    ap.add_argument("--api-key-file", help="a file of accepted keys, one a line ('#' comments)")
    ap.add_argument("--max-request-bytes", type=int, default=GuardConfig.max_request_bytes)
    ap.add_argument("--max-json-depth", type=int, default=GuardConfig.max_json_depth)
    ap.add_argument("--rate-limit-rpm", type=float,
                    help="requests per minute per client (its API key, else its address); a burst of up to a "
                         "minute's worth; over it: 429 with Retry-After (ensemble/gateway_limits.py)")
    ap.add_argument("--rate-limit-tpm", type=float,
                    help="prompt + generated tokens per minute per client, charged when each answer ends; a "
                         "client at or below zero gets 429 with Retry-After until its budget refills")
    ap.add_argument("--max-in-flight-per-client", type=int,
                    help="requests one client may have open at once (a stream counts until it ends); over it: 429")
    ap.add_argument("--probe-period", type=float, default=PROBE_PERIOD_S, help="engine liveness probe period (s)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        limits = RateLimits(args.rate_limit_rpm, args.max_in_flight_per_client, args.rate_limit_tpm)
    except ValueError as e:
        ap.error(str(e))
    guard = GuardConfig.from_args(args.api_key, args.api_key_file, args.max_request_bytes, args.max_json_depth,
                                  limits)
    json_protocol_errors()
    # handler_cancellation: a client that disconnects cancels its handler at once, even while it
    # waits for the first token or a whole non-streaming answer, so the engine request is stopped.
    # Header limits 64 KiB (aiohttp's default 8 KiB refuses ordinary large cookies/tokens).
    web.run_app(Gateway(args.triton_grpc, args.model, guard=guard, probe_period_s=args.probe_period).app(),
                host=args.host, port=args.port, handler_cancellation=True, print=lambda s: log.info(s),
                access_log=None, max_field_size=65536, max_line_size=65536)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
