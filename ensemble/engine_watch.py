"""The gateway's engine liveness probe: a dead engine process must end every open stream.

Triton 2.51 does not notice when a Python backend stub dies (kill -9, OOM): its health and ready
endpoints keep answering 200, and the decoupled requests in flight on that stub never get another
response or their FINAL, so their clients would wait forever. The gateway therefore asks the engine
model itself, every PROBE_PERIOD_S, with the cheapest request it has (a `stop` for a key no request
uses; the engine answers it with FINAL only):

    answered            -> alive
    a Triton error      -> dead at once ("Stub process ... is not healthy")
    no answer, N times  -> dead (a stub that hangs)

When it turns dead, every open ensemble call gets an error, so each stream ends with the API's error
event and its end marker, and the gateway's /health turns 503 until a probe is answered again (after
a restart of the server, or a model reload in explicit model-control mode).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable

log = logging.getLogger("deepinfer.gateway")
PROBE_TIMEOUT_S = 5.0   # a busy engine (a long CPU step, a loaded host) may be slow to answer; not dead


class EngineDead(RuntimeError):
    pass


class EngineWatch:
    def __init__(self, probe: Callable[[float], Awaitable[None]], period_s: float, timeouts_to_dead: int,
                 on_change: Callable[[bool], None] | None = None):
        self.probe, self.period_s, self.timeouts_to_dead = probe, period_s, timeouts_to_dead
        self.on_change = on_change
        self.alive = True
        self.calls: set = set()          # open EnsembleCalls (each has fail(exc))
        self._timeouts = 0
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.period_s)
            await self.check()

    async def check(self) -> None:
        try:
            await self.probe(max(PROBE_TIMEOUT_S, self.period_s))
        except asyncio.TimeoutError:
            self._timeouts += 1
            if self._timeouts >= self.timeouts_to_dead:
                self._set(False, f"no answer to {self._timeouts} probes in a row")
            return
        except Exception as e:  # noqa: BLE001 - any Triton error means the engine cannot serve
            self._set(False, str(e))
            return
        self._timeouts = 0
        self._set(True, "")

    def _set(self, alive: bool, why: str) -> None:
        if alive != self.alive:
            log.warning("engine model %s%s", "is serving again" if alive else "is dead: ", why)
            self.alive = alive
            if self.on_change is not None:
                self.on_change(alive)
        if not alive:
            for call in list(self.calls):
                call.fail(EngineDead(f"the engine model stopped answering ({why}); the request was lost"))
