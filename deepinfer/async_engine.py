"""AsyncEngine: an Engine running its step loop on a background thread.

Built for a Triton Python-backend model: requests come in from Triton's threads, outputs go out
through per-request callbacks (called on the engine thread), an asyncio iterator, or a blocking
iterator for plain threads.

    engine = AsyncEngine(EngineArgs(checkpoint="checkpoints/tiny"))
    async for out in engine.generate([0, 19, 7], SamplingParams(max_tokens=8), "req-1"):
        out.new_token_ids, out.finish_reason            # one delta per engine step
    engine.add_request("req-2", ids, params, callback)   # from any thread
    for out in engine.stream("req-3", ids, params): ...  # blocking, from any thread
    engine.abort("req-2")                                # from any thread; no tokens arrive after it

Every request ends with exactly one output whose finish_reason is set ("stop", "length", "abort",
"error"). Bad input raises in the caller's thread and never reaches the loop; a fault inside a
step fails that step's requests ("error") and the loop goes on.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator

from deepinfer.config import EngineArgs
from deepinfer.outputs import RequestOutput
from deepinfer.request import InvalidRequestError, RequestStatus, UnknownRequestError
from deepinfer.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

Callback = Callable[[RequestOutput], None]


class AsyncEngine:
    def __init__(self, args: EngineArgs | None = None, **engine_args) -> None:
        from deepinfer.engine import Engine
        if args is None:
            args = EngineArgs(**engine_args)
        self.engine = Engine(args)
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self.engine.idle_sleep = self._wakeup.wait      # a new request or abort ends an idle poll's wait
        self._lock = threading.Lock()
        self._sinks: dict[str, Callback] = {}   # live request ids (added, final output not yet delivered)
        self._aborted: set[str] = set()          # abort asked: deliver nothing but the final "abort"
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="deepinfer-engine", daemon=True)
        self._thread.start()

    # thread-safe API ---------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams | None,
                    callback: Callback, *, forced_token_ids: list[int] | None = None,
                    return_logits: bool = False, images=None, cache_salt: str | None = None,
                    kv_transfer_params: dict | None = None) -> None:
        """Queue a request; callback(RequestOutput) is called on the engine thread for each delta,
        the last one with finish_reason set. Raises InvalidRequestError here on bad input.
        images: as Engine.add_request; decoded here, on the caller's thread."""
        if self._stopped:
            raise RuntimeError("AsyncEngine is shut down")
        if images:
            images = self.engine.prepare_images(request_id, prompt_token_ids, images)
            prompt_token_ids = images.token_ids
        params = self.engine.validate(request_id, prompt_token_ids, sampling_params)
        self.engine.validate_cache_salt(request_id, cache_salt)
        if kv_transfer_params is not None:
            self.engine.check_handover(request_id, kv_transfer_params, len(prompt_token_ids))
        with self._lock:
            if request_id in self._sinks:
                raise InvalidRequestError(f"request id {request_id!r} is already in use")
            self._sinks[request_id] = callback
        self._cmds.put(("add", (request_id, list(prompt_token_ids), params, forced_token_ids, return_logits,
                                images or None, cache_salt, kv_transfer_params)))
        self._wakeup.set()

    def abort(self, request_id: str) -> None:
        """Stop a request: no token delta is delivered after this returns, then one final output
        with finish_reason "abort". Raises UnknownRequestError for an id not in flight."""
        with self._lock:
            if request_id not in self._sinks:
                raise UnknownRequestError(f"unknown request id {request_id!r}")
            self._aborted.add(request_id)
        self._cmds.put(("abort", request_id))
        self._wakeup.set()

    def stream(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams | None = None,
               **kw) -> Iterator[RequestOutput]:
        """Blocking iterator of deltas, for plain threads. Raises on bad input before yielding."""
        q: queue.SimpleQueue = queue.SimpleQueue()
        self.add_request(request_id, prompt_token_ids, sampling_params, q.put, **kw)
        return self._drain(q)

    @staticmethod
    def _drain(q) -> Iterator[RequestOutput]:
        while True:
            out = q.get()
            yield out
            if out.finished:
                return

    async def generate(self, prompt_token_ids: list[int], sampling_params: SamplingParams | None,
                       request_id: str, **kw) -> AsyncIterator[RequestOutput]:
        """Async iterator of deltas. Leaving the loop early (break, cancel) aborts the request."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        self.add_request(request_id, prompt_token_ids, sampling_params,
                         lambda out: loop.call_soon_threadsafe(q.put_nowait, out), **kw)
        finished = False
        try:
            while not finished:
                out = await q.get()
                finished = out.finished
                yield out
        finally:
            if not finished:
                try:
                    self.abort(request_id)
                except UnknownRequestError:
                    pass

    def stats(self) -> dict:
        """Counters, gauges and histograms (deepinfer/stats.py), safe from any thread."""
        return self.engine.stats.snapshot()

    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._sinks)

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Stop the loop (open requests end with "error") and the engine's rank workers."""
        self._stopped = True
        self._wakeup.set()
        self._thread.join(timeout)
        self.engine.shutdown()

    # the engine thread -------------------------------------------------------------------------
    def _loop(self) -> None:
        engine = self.engine
        while not self._stopped:
            self._wakeup.clear()
            try:
                self._apply_commands()
                if not engine.has_unfinished_requests():
                    self._wakeup.wait()
                    continue
                for out in engine.step():
                    self._deliver(out)
            except Exception as e:  # noqa: BLE001 - the loop must survive anything
                logger.exception("engine loop fault; failing all requests in flight")
                self._fail_all(e, include_pending=False)
        self._fail_all(RuntimeError("AsyncEngine shut down"), include_pending=True)

    def _apply_commands(self) -> None:
        while True:
            try:
                kind, arg = self._cmds.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._add(*arg)
            elif self.engine.holds_request(arg):
                self._deliver(self.engine.abort(arg))

    def _add(self, request_id, prompt, params, forced, return_logits, images, cache_salt, kv_transfer_params) -> None:
        try:
            self.engine.add_request(request_id, prompt if images is None else images.token_ids, params,
                                    forced_token_ids=forced, return_logits=return_logits, images=images,
                                    cache_salt=cache_salt, kv_transfer_params=kv_transfer_params)
        except Exception as e:  # noqa: BLE001
            self._deliver(RequestOutput(request_id, [], "error", len(prompt), 0, error=str(e)))

    def _deliver(self, out: RequestOutput) -> None:
        rid = out.request_id
        with self._lock:
            sink = self._sinks.get(rid)
            if sink is None:
                return
            if rid in self._aborted:
                if not out.finished:
                    return                      # no tokens after an abort
                out = RequestOutput(rid, [], "abort", out.num_prompt_tokens,
                                    out.num_output_tokens - len(out.new_token_ids))
            if out.finished:
                del self._sinks[rid]
                self._aborted.discard(rid)
        try:
            sink(out)
        except Exception:  # noqa: BLE001 - a caller's callback must not stop the engine
            logger.exception("callback of request %s raised", rid)

    def _fail_all(self, exc: Exception, include_pending: bool) -> None:
        engine = self.engine
        for out in engine.scheduler.finish_requests(list(engine.scheduler.requests), RequestStatus.FINISHED_ERROR,
                                                    error=f"{type(exc).__name__}: {exc}"):
            self._deliver(out)
        if not include_pending:
            return
        with self._lock:
            left = list(self._sinks)
        for rid in left:  # added but not yet in the engine
            self._deliver(RequestOutput(rid, [], "error", 0, 0, error=str(exc)))
