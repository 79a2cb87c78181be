"""NixlTransport: the NIXL agent of one engine instance (NVIDIA's transfer library, as vLLM's
NixlConnector uses it). UCX backend: TCP / shared memory between CPU processes, RDMA and NVLink
for GPU memory. Peers find each other's metadata through NIXL's own listener (host, port).

All calls are non-blocking except construction: the connector polls states once per engine step.
"""

from __future__ import annotations

import logging
import sys
import uuid

from deepinfer.ports import free_port

logger = logging.getLogger(__name__)


def import_nixl():
    """The NIXL Python API: the `nixl` meta package (picks the CUDA build), else a build directly."""
    for name in ("nixl", "nixl_cu13", "nixl_cu12"):
        try:
            module = __import__(name)
            if hasattr(module, "nixl_agent"):
                return module
        except ImportError:
            continue
    raise ImportError("kv_role 'prefill'/'decode' needs NIXL: pip install 'deepinfer-triton[pd]'")


def _agent(nixl, name: str, cfg, progress_wait_us: int):
    """nixl.nixl_agent(name, cfg) whose UCX progress thread waits up to progress_wait_us in poll()
    for worker events (0: NIXL's default, a busy poll). The Python API hard-codes pthrDelay 0, so
    the config class it builds is swapped, for this one construction, for one that keeps the floor."""
    if progress_wait_us <= 0:
        return nixl.nixl_agent(name, cfg)
    api = sys.modules[type(cfg).__module__]
    base = api.nixlBind.nixlAgentConfig

    class _WaitingConfig(base):
        @property
        def pthrDelay(self):
            return base.pthrDelay.__get__(self)

        @pthrDelay.setter
        def pthrDelay(self, us):
            base.pthrDelay.__set__(self, max(us, progress_wait_us))

    api.nixlBind.nixlAgentConfig = _WaitingConfig
    try:
        return nixl.nixl_agent(name, cfg)
    finally:
        api.nixlBind.nixlAgentConfig = base


class NixlTransport:
    def __init__(self, role: str, host: str = "127.0.0.1", port: int = 0, progress_wait_us: int = 0,
                 label: str = "") -> None:
        """progress_wait_us > 0: the progress thread sleeps in poll() between events (host-memory
        caches: a busy poll would take a CPU core per engine from the model's own threads).
        label: part of the agent's name (a rank worker's "rank1": the hand-over names that rank)."""
        nixl = import_nixl()
        self.host = host
        self.port = port or free_port(host)
        self.name = f"deepinfer-{role}-{label + '-' if label else ''}{uuid.uuid4().hex[:12]}"
        cfg = nixl.nixl_agent_config(enable_listen_thread=True, listen_port=self.port, backends=["UCX"])
        self.agent = _agent(nixl, self.name, cfg, progress_wait_us)
        self._asked: set[str] = set()    # peers whose metadata was requested

    # memory ------------------------------------------------------------------------------------
    def register(self, regions: list[tuple[int, int, int, str]], mem_type: str) -> None:
        self.agent.register_memory(regions, mem_type)

    # peers ---------------------------------------------------------------------------------------
    def peer_ready(self, name: str, host: str, port: int) -> bool:
        """Ask for a peer's metadata once; True when it has arrived (poll)."""
        if name not in self._asked:
            self.agent.fetch_remote_metadata(name, host, port)
            self._asked.add(name)
        return self.agent.check_remote_metadata(name)

    def forget_peer(self, name: str) -> None:
        """A peer that failed: ask for its metadata again next time (it may have restarted)."""
        if name in self._asked:
            self._asked.discard(name)
            try:
                self.agent.remove_remote_agent(name)
            except Exception:  # noqa: BLE001 - its metadata may never have arrived
                pass

    # transfers -----------------------------------------------------------------------------------
    def read(self, peer: str, local: list[tuple[int, int, int]], remote: list[tuple[int, int, int]],
             mem_type: str, notif: bytes = b""):
        """Start a READ of the remote runs into the local ones (pairwise). -> handle"""
        lo = self.agent.get_xfer_descs(local, mem_type)
        ro = self.agent.get_xfer_descs(remote, mem_type)
        handle = self.agent.initialize_xfer("READ", lo, ro, peer, notif)
        if self.agent.transfer(handle) == "ERR":
            self.agent.release_xfer_handle(handle)
            raise ConnectionError(f"NIXL READ from {peer} could not be posted")
        return handle

    def state(self, handle) -> str:
        """'DONE', 'PROC' or 'ERR'."""
        return self.agent.check_xfer_state(handle)

    def release(self, handle) -> None:
        try:
            self.agent.release_xfer_handle(handle)
        except Exception:  # noqa: BLE001 - a transfer to a dead peer may refuse to release cleanly
            logger.warning("could not release a NIXL transfer handle", exc_info=True)

    def notify(self, peer: str, msg: bytes) -> None:
        try:
            self.agent.send_notif(peer, msg)
        except Exception:  # noqa: BLE001 - the peer frees at its timeout anyway
            logger.warning("notification to %s failed", peer, exc_info=True)

    def notifications(self) -> list[bytes]:
        return [m for msgs in self.agent.get_new_notifs().values() for m in msgs]
