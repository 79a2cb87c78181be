"""Drives the async engine from the decoupled `deepinfer` Triton model (vllm_backend's pattern).

    execute(requests) -> driver.submit(EngineRequest, sender)          returns at once
    engine thread:       callback(delta) -> event queue                 (never waits on IPC)
    response thread:     event queue -> format -> sender.send(...)      (+ is_cancelled polling)

One response per engine step per streaming request (the new token ids), one response for a
non-streaming one, and FINAL always: after the last delta, an error, a cancel or a stop. The engine is
duck-typed (deepinfer.AsyncEngine: `add_request(request_id, prompt_token_ids, sampling_params,
callback)` raising ValueError on bad input, `abort(request_id)` raising KeyError when not in flight,
deltas with `new_token_ids, finish_reason, num_prompt_tokens, num_output_tokens, new_logprobs,
error`), so this module imports neither Triton nor deepinfer.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol


@dataclass
class EngineRequest:
    request_key: str
    input_ids: list[int] = field(default_factory=list)
    sampling: dict = field(default_factory=dict)
    streaming: bool = False
    context: str = ""
    stop: bool = False
    images: list = field(default_factory=list)   # [H, W, 3] uint8 per image placeholder (split_pixels)
    kv_transfer_params: str = ""                 # JSON: a prefill replica's hand-over (kv_role="decode")

    @classmethod
    def from_inputs(cls, inputs: dict) -> "EngineRequest":
        """From the engine model's inputs by contract name (None = absent)."""
        return cls(request_key=inputs["request_key"] or "", input_ids=list(inputs.get("input_ids") or []),
                   sampling=json.loads(inputs.get("sampling") or "{}"), streaming=bool(inputs.get("streaming")),
                   context=inputs.get("context") or "", stop=bool(inputs.get("stop")),
                   images=split_pixels(inputs.get("image_pixels"), inputs.get("image_sizes")),
                   kv_transfer_params=inputs.get("kv_transfer_params") or "")


def split_pixels(flat, sizes) -> list:
    """image_pixels (RGB bytes of every image, row-major, concatenated) + image_sizes [h0, w0, h1, ..]
    -> [H, W, 3] uint8 arrays; ValueError when the two do not agree."""
    import numpy as np
    sizes = [int(x) for x in (sizes if sizes is not None else [])]
    flat = np.zeros(0, np.uint8) if flat is None else np.asarray(flat, dtype=np.uint8).reshape(-1)
    if len(sizes) % 2:
        raise ValueError(f"image_sizes must hold (height, width) pairs, got {len(sizes)} values")
    out, off = [], 0
    for h, w in zip(sizes[0::2], sizes[1::2]):
        n = h * w * 3
        if h <= 0 or w <= 0 or off + n > flat.size:
            raise ValueError(f"image_pixels holds {flat.size} bytes, too few for images of sizes {sizes}")
        out.append(flat[off:off + n].reshape(h, w, 3))
        off += n
    if off != flat.size:
        raise ValueError(f"image_pixels holds {flat.size} bytes, but image_sizes {sizes} need {off}")
    return out

EARLY_STOP_TTL_S = 60.0   # how long a stop waits for a request that has not arrived


class Sender(Protocol):
    def send(self, outputs: dict | None, final: bool) -> None: ...        # outputs by contract name
    def send_error(self, message: str, code: str) -> None: ...            # error response + FINAL
    def is_cancelled(self) -> bool: ...


class Observer(Protocol):
    def observe_ttft(self, seconds: float) -> None: ...
    def observe_itl(self, seconds: float) -> None: ...


@dataclass
class _Active:
    """Per-request state of one engine request (touched by the response thread only)."""
    req: EngineRequest
    sender: Sender
    start: float = field(default_factory=time.monotonic)
    last: float = 0.0
    context_sent: bool = False
    done: bool = False
    stopped: bool = False
    token_ids: list[int] = field(default_factory=list)     # non-streaming: accumulated
    logprobs: list[Any] = field(default_factory=list)

    def outputs(self, ids, logprobs, finish_reason, num_prompt, num_output, num_cached=0, kv_transfer_params=None) -> dict:
        context = "" if self.context_sent else self.req.context
        self.context_sent = True
        return {"output_ids": ids, "logprobs": _logprobs_json(logprobs), "finish_reason": finish_reason or "",
                "num_input_tokens": num_prompt, "num_output_tokens": num_output, "num_cached_tokens": num_cached,
                "context": context, "request_key": self.req.request_key,
                "kv_transfer_params": json.dumps(kv_transfer_params) if kv_transfer_params else ""}


class EngineDriver:
    def __init__(self, engine, make_sampling_params: Callable[[dict], Any], observer: Observer | None = None):
        self.engine = engine
        self.make_sampling_params = make_sampling_params
        self.observer = observer
        self.active: dict[str, _Active] = {}
        # stops that arrived before their request (a client gone while its request was in the
        # preprocess): the request is answered "abort" on arrival instead of running to the end
        self._early_stops: dict[str, float] = {}
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._drain, name="deepinfer-responses", daemon=True)
        self._thread.start()

    # -- called from execute() ----------------------------------------------------------------
    def submit(self, req: EngineRequest, sender: Sender) -> None:
        if req.stop:
            self.stop(req.request_key)
            sender.send(None, True)
            return
        state = _Active(req, sender)
        if self._early_stops.pop(req.request_key, None) is not None:
            sender.send(state.outputs([], None, "abort", len(req.input_ids), 0), True)
            return
        if not req.input_ids:   # rejected by the preprocess: answer at once (the context has the error)
            sender.send(state.outputs([], None, "error", 0, 0), True)
            return
        try:
            sampling = dict(req.sampling)
            salt = sampling.pop("cache_salt", None)   # the prefix cache's tenant key, not a sampling knob
            params = self.make_sampling_params(sampling)
            if req.request_key in self.active:
                raise ValueError(f"request key {req.request_key!r} is already running")
            self.active[req.request_key] = state
            extra = {"images": req.images} if req.images else {}
            if req.kv_transfer_params:   # a hand-over: the engine pulls the prefill's caches (or refuses)
                extra["kv_transfer_params"] = _handover(req.kv_transfer_params)
            self.engine.add_request(req.request_key, req.input_ids, params,
                                    lambda delta: self._events.put((state, delta)), **extra,
                                    **({"cache_salt": salt} if salt is not None else {}))
        except (TypeError, ValueError) as e:   # the engine's admission checks (a grammar it cannot compile...)
            if self.active.get(req.request_key) is state:
                del self.active[req.request_key]
            self._reject(state, str(e))

    def _reject(self, state: _Active, message: str) -> None:
        """A client error found at admission: through the ensemble it is an ordinary last response
        whose context carries status 400 and the message (the postprocess writes the API's error
        body, as for the preprocess's own rejections); called directly, a Triton INVALID_ARG."""
        if not state.req.context:
            state.sender.send_error(message, "INVALID_ARG")
            return
        ctx = json.loads(state.req.context)
        ctx.update(error_status=400, error_message=message)
        state.req.context = json.dumps(ctx, ensure_ascii=False)
        state.sender.send(state.outputs([], None, "error", len(state.req.input_ids), 0), True)

    def stop(self, request_key: str) -> None:
        """The explicit stop input (a gateway, or the postprocess on a matched stop sequence)."""
        state = self.active.get(request_key)
        if state is not None:
            state.stopped = True
            self._abort(request_key)
            return
        now = time.monotonic()
        self._early_stops = {k: t for k, t in self._early_stops.items() if now - t < EARLY_STOP_TTL_S}
        self._early_stops[request_key] = now

    def shutdown(self, timeout: float = 10.0) -> None:
        for key in list(self.active):
            self.stop(key)
        deadline = time.monotonic() + timeout
        while self.active and time.monotonic() < deadline:
            time.sleep(0.05)
        self._events.put(None)
        self._thread.join(timeout)

    # -- on the response thread -----------------------------------------------------------------
    def _drain(self) -> None:
        while (item := self._events.get()) is not None:
            state, delta = item
            if state.done:
                continue
            try:
                self._handle(state, delta)
            except Exception as e:  # noqa: BLE001 - a dead client must not stop the other streams
                self._finish(state)
                try:
                    state.sender.send_error(f"{type(e).__name__}: {e}", "INTERNAL")
                except Exception:  # noqa: BLE001
                    pass

    def _handle(self, state: _Active, delta) -> None:
        finished = delta.finish_reason is not None
        self._observe(state, delta)
        if not finished and not state.stopped and state.sender.is_cancelled():
            self._abort(state.req.request_key)
            self._finish(state)
            state.sender.send_error("request was cancelled", "CANCELLED")
            return
        if delta.finish_reason == "error":
            self._finish(state)
            state.sender.send_error(delta.error or "engine error", "INTERNAL")
            return
        new_lp = list(delta.new_logprobs) if delta.new_logprobs else []
        handover = getattr(delta, "kv_transfer_params", None)   # kv_role="prefill": on the last delta
        if finished:
            self._finish(state)
            observe_e2e = getattr(self.observer, "observe_e2e", None)
            if observe_e2e is not None:
                observe_e2e(time.monotonic() - state.start)
        if state.req.streaming:
            if delta.new_token_ids or finished:
                state.sender.send(state.outputs(list(delta.new_token_ids), new_lp, delta.finish_reason,
                                                delta.num_prompt_tokens, delta.num_output_tokens,
                                                delta.num_cached_tokens, handover), finished)
            return
        state.token_ids += list(delta.new_token_ids)
        state.logprobs += new_lp
        if finished:
            state.sender.send(state.outputs(state.token_ids, state.logprobs, delta.finish_reason,
                                            delta.num_prompt_tokens, delta.num_output_tokens,
                                            delta.num_cached_tokens, handover), True)

    def _finish(self, state: _Active) -> None:
        state.done = True
        if self.active.get(state.req.request_key) is state:
            del self.active[state.req.request_key]

    def _observe(self, state: _Active, delta) -> None:
        if self.observer is None or not delta.new_token_ids:
            return
        now = time.monotonic()
        if state.last == 0.0:
            self.observer.observe_ttft(now - state.start)
        else:
            self.observer.observe_itl((now - state.last) / len(delta.new_token_ids))
        state.last = now

    def _abort(self, request_key: str) -> None:
        try:
            self.engine.abort(request_key)
        except KeyError:   # already finished
            pass


def _handover(text: str) -> dict:
    """The kv_transfer_params input -> the engine's dict (ValueError: the client's 400)."""
    try:
        params = json.loads(text)
    except ValueError as e:
        raise ValueError(f"kv_transfer_params is not JSON: {e}") from None
    if not isinstance(params, dict):
        raise ValueError(f"kv_transfer_params must be a JSON object, got {type(params).__name__}")
    return params


def _logprobs_json(entries: list) -> str:
    """[(logprob, [(id, logprob), ...]), ...] as JSON; "" when logprobs are off."""
    if not entries:
        return ""
    out = []
    for e in entries:
        if isinstance(e, dict):
            e = (e.get("logprob"), e.get("top_logprobs") or e.get("top") or [])
        lp, top = e[0], e[1] if len(e) > 1 else []
        out.append([float(lp), [[int(i), float(p)] for i, p in (top.items() if isinstance(top, dict) else top)]])
    return json.dumps(out)
