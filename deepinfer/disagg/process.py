"""EngineProcess: an AsyncEngine in a spawned child process (a prefill or decode instance for tests
and benchmarks; the served topology runs one per Triton replica instead).

    p = EngineProcess(dict(checkpoint=..., device="cpu", kv_role="prefill"))
    final = list(p.stream("r1", prompt, SamplingParams(max_tokens=8)))[-1]   # RequestOutput deltas
    p.state()   # {"cache_blocks_used": .., "held": .., "loading": .., ...} of the child's engine
    p.kill()    # SIGKILL: a peer that goes down mid-request
    p.close()
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import threading
from collections.abc import Iterator

from deepinfer.outputs import RequestOutput

STARTUP_TIMEOUT_S = 300.0


def _serve(engine_args: dict, num_threads: int | None, cmds, outs) -> None:
    import torch

    from deepinfer.async_engine import AsyncEngine
    from deepinfer.config import EngineArgs
    if num_threads:
        torch.set_num_threads(num_threads)
    try:
        engine = AsyncEngine(EngineArgs(**engine_args))
    except Exception as e:  # noqa: BLE001 - reported to the parent
        outs.put(("failed", f"{type(e).__name__}: {e}"))
        return
    outs.put(("ready", None))
    while True:
        cmd, *args = cmds.get()
        if cmd == "stop":
            break
        if cmd == "add":
            rid, prompt, params, kw = args
            try:
                engine.add_request(rid, prompt, params, lambda o: outs.put(("out", o)), **kw)
            except Exception as e:  # noqa: BLE001 - bad input: this request only
                outs.put(("out", RequestOutput(rid, [], "error", len(prompt), 0, error=f"{type(e).__name__}: {e}")))
        elif cmd == "abort":
            try:
                engine.abort(args[0])
            except KeyError:
                pass
        elif cmd == "state":
            outs.put(("state", _state(engine.engine)))
    engine.shutdown()
    outs.put(("stopped", None))


def _state(engine) -> dict:
    c, kv = engine.connector, engine.kv_cache
    ranks = getattr(kv, "per_rank", [kv])          # DataParallelScheduler: each rank's KVCacheManager
    return {"cache_blocks_used": kv.num_used_blocks, "ring_slots_used": sum(len(k.ring_slot) for k in ranks),
            "rank_blocks_used": [k.num_used_blocks for k in ranks],
            "requests": len(engine.scheduler.requests), "held": len(c.held) if c else 0,
            "loading": len(c.loads) if c else 0, "stats": engine.stats.snapshot(),
            "images_encoded": _images_encoded(engine), "rank_pids": getattr(engine.runner, "pids", []),
            "cp_prefills": len(getattr(engine.scheduler, "cp_prefills", ())),
            "async_scheduling": engine.async_scheduling}


def _images_encoded(engine) -> int:
    """Images this instance ran through its vision tower (ahead of the steps or inside one)."""
    enc, embeds = engine.image_encoder, getattr(engine.runner, "images", None)
    return getattr(enc, "num_encoded", 0) + (embeds.num_encoded if embeds is not None else 0)


class EngineProcess:
    def __init__(self, engine_args: dict, num_threads: int | None = None, name: str = "deepinfer-engine") -> None:
        ctx = mp.get_context("spawn")
        self._cmds, self._outs = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=_serve, args=(engine_args, num_threads, self._cmds, self._outs),
                                daemon=True, name=name)
        self.proc.start()
        kind, msg = self._outs.get(timeout=STARTUP_TIMEOUT_S)
        if kind != "ready":
            self.proc.join(5)
            raise RuntimeError(f"engine process failed to start: {msg}")
        self._sinks: dict[str, queue.SimpleQueue] = {}
        self._replies: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                kind, msg = self._outs.get(timeout=0.5)
            except queue.Empty:
                if not self.proc.is_alive():
                    self._fail_open("engine process died")
                    return
                continue
            except (EOFError, OSError):
                self._fail_open("engine process died")
                return
            if kind == "out":
                with self._lock:
                    sink = self._sinks.pop(msg.request_id, None) if msg.finished else self._sinks.get(msg.request_id)
                if sink is not None:
                    sink.put(msg)
            elif kind == "stopped":
                return
            else:
                self._replies.put(msg)

    def _fail_open(self, why: str) -> None:
        with self._lock:
            sinks, self._sinks = self._sinks, {}
        for rid, sink in sinks.items():
            sink.put(RequestOutput(rid, [], "error", 0, 0, error=why))

    def add(self, request_id: str, prompt_token_ids: list[int], sampling_params=None, **kw) -> queue.SimpleQueue:
        """Queue a request; its RequestOutput deltas arrive on the returned queue."""
        q: queue.SimpleQueue = queue.SimpleQueue()
        with self._lock:
            self._sinks[request_id] = q
        self._cmds.put(("add", request_id, list(prompt_token_ids), sampling_params, kw))
        return q

    def stream(self, request_id: str, prompt_token_ids: list[int], sampling_params=None, timeout: float = 300.0,
               **kw) -> Iterator[RequestOutput]:
        q = self.add(request_id, prompt_token_ids, sampling_params, **kw)
        while True:
            out = q.get(timeout=timeout)
            yield out
            if out.finished:
                return

    def abort(self, request_id: str) -> None:
        self._cmds.put(("abort", request_id))

    def state(self, timeout: float = 30.0) -> dict:
        self._cmds.put(("state",))
        return self._replies.get(timeout=timeout)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(10)

    def close(self, timeout: float = 30.0) -> None:
        if self.proc.is_alive():
            self._cmds.put(("stop",))
            self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)
