"""MultiprocExecutor: the driver's side of the rank workers, with the ModelRunner's interface
(launch / resolve / execute) over a ParallelSchedulerOutput, so the Engine's step is unchanged.

    launch(plan):  every rank gets its own SchedulerOutput, the step's largest rank size and its
                   shares of the step's balanced-CP prefills (parallel/cp.py), if any
    resolve(h):    every rank's ModelRunnerOutput, in rank order

Start: N fresh interpreters (never fork: CUDA and a Triton stub's threads do not survive it) that
call back on a local authenticated socket, a torch.distributed TCP rendezvous on a free local
port, and each rank reports its cache size; the engine schedules with the smallest. A rank that dies (its sentinel fires) or fails (its "error" reply) makes the
executor raise EngineDeadError naming the rank and why, after every worker is stopped: the peers
of a rank that failed inside a step may wait in a collective forever, so none is left running.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import subprocess
import sys
import time
import weakref
from multiprocessing.connection import Listener, wait

from deepinfer.ports import free_port
from deepinfer.request import EngineDeadError

from .dp_scheduler import ParallelSchedulerOutput
from .setup import check_parallel_args
from .worker import WorkerSpec

logger = logging.getLogger(__name__)

JOIN_SECONDS = 10.0
ACCEPT_POLL_SECONDS = 0.5


class MultiprocExecutor:
    def __init__(self, args, facts) -> None:
        self.args = args
        self.world_size = args.data_parallel_size
        device = args.resolved_device()
        check_parallel_args(args, facts.model_args, _num_gpus() if device.startswith("cuda") else None)
        _check_checkpoint(args, facts.model_args)
        if device.startswith("cuda"):
            _check_memory(args, facts.model_args)
        self.procs: list = []
        self.conns: list = []
        self.dead: str | None = None
        self._graceful = [True]          # False once a rank failed: the others are killed, not asked
        self._steps = 0
        self._overlap_answers: tuple | None = None   # (the launched plan, each rank's answer about it)
        self.last_rebalance: dict | None = None
        from .lockstep import HostAgreement
        self.agreement = HostAgreement.create(self.world_size)     # the ranks' per-step graph agreement
        # the node's one copy of the Engram tables in host memory: its files' prefix (model/host_tables.py)
        self.host_tables = (f"deepinfer-engram-{os.getpid()}-{secrets.token_hex(4)}"
                            if args.resolved_engram_placement() == "host" else None)
        self._finalizer = weakref.finalize(self, _stop, self.procs, self.conns, self._graceful, self.agreement,
                                           self.host_tables)
        self._start(args, facts, device)

    # start and stop ------------------------------------------------------------------------------
    def _start(self, args, facts, device: str) -> None:
        backend = args.distributed_backend or ("nccl" if device.startswith("cuda") else "gloo")
        init = f"tcp://127.0.0.1:{free_port()}"
        threads = args.worker_threads or max(1, (os.cpu_count() or 1) // self.world_size)
        authkey = secrets.token_bytes(16)
        with Listener(("127.0.0.1", 0), authkey=authkey) as listener:
            env = dict(os.environ, DEEPINFER_WORKER_ADDR="%s:%d" % listener.address,
                       DEEPINFER_WORKER_AUTHKEY=authkey.hex())
            for r in range(self.world_size):
                self.procs.append(_WorkerProcess(r, env))
            conns = [self._accept(listener) for _ in range(self.world_size)]
        self.conns.extend(c for _, c in sorted(conns, key=lambda rc: rc[0]))
        for r, conn in enumerate(self.conns):
            spec = WorkerSpec(r, self.world_size, init, backend, f"cuda:{r}" if device.startswith("cuda") else "cpu",
                              threads, os.getpid(), self.agreement, self.host_tables)
            self._send(conn, (spec, args, facts))
        try:
            infos = self._gather("ready")
        except EngineDeadError as e:
            raise RuntimeError(f"multi-GPU engine failed to start: {e}") from None
        self.rank_infos = infos
        self.num_cache_blocks = min(i["num_cache_blocks"] for i in infos)
        self.max_model_len = min(i["max_model_len"] for i in infos)
        self.async_scheduling = all(i["async_scheduling"] for i in infos)
        logger.info("%d ranks up (%s backend): %d cache blocks each", self.world_size, backend, self.num_cache_blocks)

    def _accept(self, listener) -> tuple:
        """(rank, connection) of the next worker that calls in; a worker that dies first fails the start."""
        listener._listener._socket.settimeout(ACCEPT_POLL_SECONDS)
        while True:
            try:
                conn = listener.accept()
                return conn.recv(), conn
            except (socket.timeout, TimeoutError):
                for r, p in enumerate(self.procs):
                    if p.poll() is not None:
                        self._fail(f"rank {r} (pid {p.pid}) died while starting: {self._exit_status(r)}")

    def shutdown(self) -> None:
        self._finalizer()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    # the step --------------------------------------------------------------------------------------
    def execute(self, plan: ParallelSchedulerOutput):
        return self.resolve(self.launch(plan))

    def launch(self, plan: ParallelSchedulerOutput):
        """Send every rank its plan; None when no rank has tokens (the plans still carry finished /
        preempted ids the runners must drop)."""
        self._check_alive()
        max_tokens = plan.max_rank_tokens
        shares = plan.cp or [[]] * self.world_size
        for conn, so, share in zip(self.conns, plan.per_rank, shares):
            self._send(conn, ("launch", so, max_tokens, share))
        if max_tokens == 0:
            return None
        self._steps += 1
        if self._eplb_due():
            self.rebalance()
        return plan

    def launch_overlapped(self, plan: ParallelSchedulerOutput, prev):
        """A verify step scheduled with `prev` unresolved: each rank builds its part from its own launched
        step's device state (a rank's plan says whether it overlaps, SchedulerOutput.overlapped)."""
        return self.launch(plan)

    def must_resolve_before_next(self, handle) -> bool:
        """Speculation: whether some rank's launched step samples (its next step's positions and drafts
        follow from its accepted counts); one round trip to the ranks, whose answers overlap_drafts reuses."""
        return handle is not None and any(a[0] for a in self._overlap_state(handle))

    def overlap_drafts(self, handle) -> dict[str, int] | None:
        """req_id -> drafts it verifies, over every rank's launched step, where each rank's requests
        drafted on the device (the next verify step may overlap it); None: resolve first."""
        if handle is None:
            return None
        merged: dict[str, int] = {}
        for _, drafts, has_step in self._overlap_state(handle):
            if has_step and drafts is None:
                return None
            merged.update(drafts or {})
        return merged

    def _overlap_state(self, handle) -> list:
        """Each rank's (must resolve first, overlap drafts, launched a step) about its newest launched step."""
        if self._overlap_answers is None or self._overlap_answers[0] is not handle:
            for conn in self.conns:
                self._send(conn, ("overlap",))
            self._overlap_answers = (handle, self._gather("ok"))
        return self._overlap_answers[1]

    def resolve(self, handle):
        if self._overlap_answers is not None and self._overlap_answers[0] is handle:
            self._overlap_answers = None
        if handle is None:
            from deepinfer.outputs import ModelRunnerOutput
            return [ModelRunnerOutput([], []) for _ in range(self.world_size)]
        for conn in self.conns:
            self._send(conn, ("resolve",))
        return self._gather("result")

    def rebalance(self) -> list[dict]:
        """EPLB now, on every rank (between steps in each rank's message order)."""
        for conn in self.conns:
            self._send(conn, ("rebalance",))
        res = self._gather("ok")
        self.last_rebalance = res[0]          # every rank planned from the same summed window
        logger.info("EPLB: max/mean rank load %.3f -> %.3f, %d expert slots moved per rank (rank 0)",
                    res[0]["balance_before"], res[0]["balance_after"], res[0]["num_moved"])
        return res

    def score(self, prompts: list, forced: list, opts: dict) -> list[dict]:
        """deepinfer-score over the ranks: prompt i on rank i mod N; results in prompt order."""
        n = self.world_size
        share = [[(prompts[i], forced[i]) for i in range(r, len(prompts), n)] for r in range(n)]
        width = max(len(s) for s in share)
        for conn, jobs in zip(self.conns, share):
            self._send(conn, ("score", jobs, width, opts))
        per_rank = self._gather("result")
        return [per_rank[i % n][i // n] for i in range(len(prompts))]

    def encode_images(self, jobs: list[list], drops: list[list[str]]) -> list[list]:
        """Rank r starts encoding jobs[r] and frees drops[r] (parallel/image_ahead.py); -> each rank's
        (images whose pass has finished, prompts that failed to encode)."""
        for conn, j, d in zip(self.conns, jobs, drops):
            self._send(conn, ("images", j, d))
        return self._gather("ok")

    def kv_transfer(self, commands: list) -> list:
        """Rank r runs commands[r] on its NIXL agent (disagg/rank_transfer.py); -> each rank's RankKVReport."""
        for conn, cmds in zip(self.conns, commands):
            self._send(conn, ("kv", cmds))
        return self._gather("kv")

    def ping(self) -> list[dict]:
        for conn in self.conns:
            self._send(conn, ("ping",))
        return self._gather("ok")

    def _eplb_due(self) -> bool:
        a = self.args
        if not (a.enable_eplb and a.expert_parallel):
            return False
        first = max(1, a.eplb_step_interval // 4)
        return self._steps >= first and (self._steps - first) % a.eplb_step_interval == 0

    # messages ----------------------------------------------------------------------------------------
    def _send(self, conn, msg) -> None:
        self._check_alive()          # once failed, the workers are stopped (and their list emptied)
        try:
            conn.send(msg)
        except (OSError, EOFError):
            self._fail(f"rank {self.conns.index(conn)} is unreachable ({self._exit_status(self.conns.index(conn))})")

    def _gather(self, kind: str) -> list:
        """One reply of `kind` per rank, in rank order; a dead or failed rank raises EngineDeadError."""
        replies: dict[int, object] = {}
        by_conn = {id(c): r for r, c in enumerate(self.conns)}
        by_sentinel = {p.sentinel: r for r, p in enumerate(self.procs)}
        while len(replies) < self.world_size:
            waiting = [c for r, c in enumerate(self.conns) if r not in replies]
            ready = wait(waiting + [self.procs[r].sentinel for r in range(self.world_size) if r not in replies])
            for obj in ready:
                if obj in by_sentinel and by_sentinel[obj] not in replies and not self.conns[by_sentinel[obj]].poll():
                    r = by_sentinel[obj]
                    self._fail(f"rank {r} (pid {self.procs[r].pid}) died: {self._exit_status(r)}")
                if id(obj) not in by_conn:
                    continue
                r = by_conn[id(obj)]
                try:
                    tag, payload = obj.recv()
                except (OSError, EOFError):
                    self._fail(f"rank {r} (pid {self.procs[r].pid}) died: {self._exit_status(r)}")
                if tag == "error":
                    self._fail(str(payload).strip())
                if tag != kind:
                    self._fail(f"rank {r} answered {tag!r} where {kind!r} was expected")
                replies[r] = payload
        return [replies[r] for r in range(self.world_size)]

    def _exit_status(self, r: int) -> str:
        p = self.procs[r]
        p.join(0.5)
        code = p.exitcode
        if code is None:
            return "no answer"
        return f"killed by signal {-code}" if code < 0 else f"exit code {code}"

    def _fail(self, why: str):
        self.dead = why
        logger.error("multi-GPU engine: %s; stopping every rank", why)
        self._graceful[0] = False
        self._finalizer()
        raise EngineDeadError(why)

    def _check_alive(self) -> None:
        if self.dead is not None:
            raise EngineDeadError(self.dead)


def _stop(procs: list, conns: list, graceful: list, agreement: str | None = None,
          host_tables: str | None = None) -> None:
    """Ask every rank to stop (gracefully, unless one failed: its peers may sit in a collective),
    then kill what did not: no orphan processes; then the ranks' agreement segment goes."""
    if graceful[0]:
        for conn in conns:
            try:
                conn.send(("shutdown",))
            except (OSError, EOFError, ValueError):
                pass
        deadline = time.monotonic() + JOIN_SECONDS
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(JOIN_SECONDS)
    for conn in conns:
        conn.close()
    for p in procs:
        p.close()
    procs.clear()
    if agreement is not None:
        from .lockstep import HostAgreement
        HostAgreement.unlink(agreement)
    if host_tables is not None:             # a load that died between writing a table and every rank mapping it
        from deepinfer.model.host_tables import remove_leftovers
        remove_leftovers(host_tables)


class _WorkerProcess:
    """A rank worker: `python -m deepinfer.parallel.worker` (a fresh interpreter, as spawn gives, but
    one that never re-imports the caller's main script, which a Triton stub or an unguarded
    script cannot survive), with a pidfd as its exit sentinel for multiprocessing's wait()."""

    def __init__(self, rank: int, env: dict) -> None:
        self.rank = rank
        self.popen = subprocess.Popen([_python(), "-m", "deepinfer.parallel.worker", str(rank)], env=env)
        self.pid = self.popen.pid
        self.sentinel = os.pidfd_open(self.pid)

    def poll(self):
        return self.popen.poll()

    @property
    def exitcode(self):
        return self.popen.poll()

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def join(self, timeout: float | None = None) -> None:
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def kill(self) -> None:
        if self.is_alive():
            self.popen.kill()

    def close(self) -> None:
        os.close(self.sentinel)


def _python() -> str:
    """This interpreter; inside an embedding host (a Triton stub) sys.executable may not be a python."""
    exe = sys.executable
    if exe and os.path.basename(exe).startswith("python"):
        return exe
    return os.path.join(sys.exec_prefix, "bin", "python3")


def _check_checkpoint(args, model_args) -> None:
    """Every header against the config, here before any rank starts (a missing expert of any rank
    fails with one message naming the tensor)."""
    if args.load_format == "safetensors":
        from pathlib import Path

        from deepinfer.model.loader import checkpoint_index, validate
        validate(model_args, checkpoint_index(Path(args.checkpoint)))


def _check_memory(args, model_args) -> None:
    """deepinfer-plan's verdict for these sizes on this machine's GPUs; refuse to start if it does not fit."""
    import torch

    from deepinfer.worker.loading import planned_expert_share, resolved_expert_format

    from .planner import check_fits, plan_memory
    plan = plan_memory(model_args, num_gpus=args.data_parallel_size,
                       gpu_memory_bytes=torch.cuda.get_device_properties(0).total_memory,
                       num_redundant_experts=args.num_redundant_experts,
                       engram_placement=args.resolved_engram_placement(),
                       max_model_len=args.max_model_len or 65536, max_num_seqs=args.max_num_seqs,
                       block_tokens=args.block_tokens,
                       expert_format=resolved_expert_format(
                           args.expert_format, "cuda", args.batch_invariant, model_args,
                           planned_expert_share(model_args, args.data_parallel_size, args.num_redundant_experts)))
    check_fits(plan)


def _num_gpus() -> int:
    import torch
    return torch.cuda.device_count()
