"""The rank worker process: one per GPU (or per CPU slice with gloo), started with spawn.

    worker_main: pin the GPU (before any CUDA call) -> join the process group -> build the rank
                 (its experts only) -> report "ready" -> serve the driver's messages in order

Messages from the driver (a duplex Pipe; replies in request order):
    ("launch", SchedulerOutput, max_rank_tokens, [CPShare])   no reply. CP shares first: this rank's
                 chunks of long prompts' prefills (parallel/cp.py; every rank has one of each). Then
                 the runner launches the plan; a rank with no tokens of its own while others have
                 some runs the idle step (every MoE layer's collectives: the captured size the others
                 replay, all padding, or the eager idle forward; lockstep.py). max_rank_tokens == 0:
                 nothing runs anywhere (state only).
    ("resolve",)          -> ("result", ModelRunnerOutput) of the oldest launched step
    ("overlap",)          -> ("ok", (must resolve first, drafts it verifies per request or None, launched a
                 step)) about the newest launched step: the engine's question before scheduling a verify
                 step that overlaps it (spec/overlap.py; a plan with SchedulerOutput.overlapped is then
                 launched from that step's device state)
    ("rebalance",)        -> ("ok", stats): EPLB over the ranks' summed load window, weights moved
    ("score", jobs, num_forwards, opts) -> ("result", [dict]): deepinfer-score's per-prompt outputs
                 for this rank's prompts, each rank running the same number of forwards
    ("images", jobs, drops) -> ("ok", ([(key, indices)], {key: error})): start one pass over the jobs'
                 images on this rank's share of the SMs, free the dropped prompts; the images whose pass
                 is done, and the prompts that failed to encode (image_ahead.py)
    ("kv", RankKVCommands) -> ("kv", RankKVReport): kv_role "prefill"/"decode", this rank's NIXL agent over
                 its own caches: tags written, READs posted and polled, notifications read
                 (disagg/rank_transfer.py; the engine's half is disagg/rank_connector.py)
    ("ping",)             -> ("ok", gauges: EPLB moves, CP shares, step and collective seconds, the
                 CUDA-graph steps (padding-only ones apart) and the steps lockstep sent to eager)
    ("shutdown",)         the loop ends, the group is destroyed, the process exits
Any exception -> ("error", traceback text), and the worker exits: a rank that failed inside a
step may have left its peers inside a collective, so the driver tears all of them down.

The worker also exits on its own when the driver process is gone (a watcher thread polls the
parent pid): no orphaned ranks holding GPU memory.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass

logger = logging.getLogger(__name__)

PARENT_POLL_SECONDS = 0.5


@dataclass
class WorkerSpec:
    """What a rank needs to start (pickled to the spawned process)."""
    rank: int
    world_size: int
    init_method: str          # torch.distributed rendezvous, tcp://127.0.0.1:port
    backend: str              # "gloo" | "nccl"
    device: str               # "cpu" | "cuda:<rank>"
    threads: int | None       # torch threads (CPU ranks)
    parent_pid: int
    agreement: str | None = None   # lockstep.HostAgreement's segment (the executor's)
    host_tables: str | None = None  # the Engram tables' /dev/shm prefix (engram_placement="host")


def main(rank: int) -> None:
    """Entry point (`python -m deepinfer.parallel.worker RANK`): call the driver back on the address
    in the environment, receive the spec, run."""
    from multiprocessing.connection import Client
    host, port = os.environ["DEEPINFER_WORKER_ADDR"].rsplit(":", 1)
    conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ["DEEPINFER_WORKER_AUTHKEY"]))
    conn.send(rank)
    spec, args, facts = conn.recv()
    worker_main(spec, args, facts, conn)


def worker_main(spec: WorkerSpec, args, facts, conn) -> None:
    _watch_parent(spec)
    try:
        rank = _start_rank(spec, args, facts)
        from deepinfer import host_gc
        host_gc.freeze_startup_heap()     # a serving process from here: collections skip the rank's build
        conn.send(("ready", rank.info()))
        rank.serve(conn)
    except Exception:  # noqa: BLE001 - reported to the driver, then this process ends
        try:
            conn.send(("error", f"rank {spec.rank}: {traceback.format_exc()}"))
        except (OSError, EOFError):
            pass
        _exit(spec, 1)
    _exit(spec, 0)


def _exit(spec: WorkerSpec, code: int) -> None:
    if os.getppid() != spec.parent_pid:     # the driver is gone (its connection broke with it)
        _remove_driver_names(spec)
    os._exit(code)


def _watch_parent(spec: WorkerSpec) -> None:
    def watch():
        while True:
            if os.getppid() != spec.parent_pid:
                _exit(spec, 1)
            time.sleep(PARENT_POLL_SECONDS)
    threading.Thread(target=watch, name="deepinfer-parent-watch", daemon=True).start()


def _remove_driver_names(spec: WorkerSpec) -> None:
    """A driver killed outright never ran its stop: its /dev/shm names (the lockstep agreement, what is left of the
    host Engram tables) go with its ranks instead of outliving them."""
    if spec.rank != 0:
        return
    try:
        if spec.agreement is not None:
            from .lockstep import HostAgreement
            HostAgreement.unlink(spec.agreement)
        if spec.host_tables is not None:
            from deepinfer.model.host_tables import remove_leftovers
            remove_leftovers(spec.host_tables)
    except Exception:  # noqa: BLE001 - exiting regardless
        pass


def _start_rank(spec: WorkerSpec, args, facts) -> "_Rank":
    import torch
    import torch.distributed as dist
    if spec.device.startswith("cuda"):
        torch.cuda.set_device(int(spec.device.split(":")[1]))   # before any other CUDA call
    elif spec.threads:
        torch.set_num_threads(spec.threads)
    dist.init_process_group(spec.backend, init_method=spec.init_method, rank=spec.rank, world_size=spec.world_size)
    from .setup import parallel_state
    from deepinfer.worker.rank import build_rank
    parallel = parallel_state(args, facts.model_args, spec.rank, spec.world_size)
    parallel.host_agreement, parallel.host_tables = spec.agreement, spec.host_tables
    rt = build_rank(args, facts, parallel=parallel, device=spec.device)
    return _Rank(spec, args, parallel, rt)


class _Rank:
    def __init__(self, spec: WorkerSpec, args, parallel, rt) -> None:
        self.spec, self.args, self.parallel, self.rt = spec, args, parallel, rt
        self.in_flight: deque = deque()      # launched steps awaiting resolve (async scheduling: 2)
        self.ep = parallel.placement is not None
        self.num_rebalances = self.num_moved = 0
        self.num_cp_prefills = 0                       # balanced-CP prefill shares this rank ran
        self.images = None                             # RankImages (image_ahead.py): encodes ahead of the steps
        self.step_seconds, self.num_steps = 0.0, 0     # launch + resolve wall time of forward steps
        self.kv = self._kv_transfer() if args.kv_role != "both" else None   # P/D: this rank's NIXL agent

    def _kv_transfer(self):
        from deepinfer.disagg.rank_transfer import RankTransfer
        a, rank = self.args, self.spec.rank
        port = a.kv_transfer_port + rank if a.kv_transfer_port else 0      # one listener per rank's agent
        return RankTransfer(a.kv_role, self.rt.caches, a.max_num_seqs, a.kv_transfer_host, port, rank)

    def info(self) -> dict:
        rt = self.rt
        return {"num_cache_blocks": rt.num_cache_blocks, "max_model_len": rt.max_model_len,
                "async_scheduling": rt.async_scheduling, "device": rt.device, "pid": os.getpid(),
                "kv": self.kv.info() if self.kv is not None else None}

    def serve(self, conn) -> None:
        import torch
        import torch.distributed as dist
        with torch.inference_mode():     # every message runs model code (steps, idle steps, EPLB)
            self._serve(conn)
        dist.destroy_process_group()

    def _serve(self, conn) -> None:
        while True:
            msg = conn.recv()
            kind = msg[0]
            if kind == "shutdown":
                break
            t = time.perf_counter()
            if kind == "launch":
                self._launch(msg[1], msg[2], msg[3])
                self.step_seconds += time.perf_counter() - t
            elif kind == "resolve":
                out = self.rt.runner.resolve(self.in_flight.popleft())
                self.step_seconds += time.perf_counter() - t
                self.num_steps += 1
                conn.send(("result", out))
            elif kind == "rebalance":
                conn.send(("ok", self._rebalance()))
            elif kind == "score":
                conn.send(("result", self._score(*msg[1:])))
            elif kind == "ping":
                conn.send(("ok", self._gauges()))
            elif kind == "overlap":
                conn.send(("ok", self._overlap_state()))
            elif kind == "kv":
                conn.send(("kv", self.kv.handle(msg[1])))
            elif kind == "images":
                conn.send(("ok", self._images().handle(msg[1], msg[2])))
            else:
                raise ValueError(f"unknown message {kind!r}")

    def _images(self):
        """The rank's encoder of images ahead of their steps, made on first use."""
        if self.images is None:
            from .image_ahead import RankImages
            self.images = RankImages(self.rt.runner.images, self.args.vision_sm_share)
        return self.images

    def _launch(self, sched_out, max_rank_tokens: int, shares=()) -> None:
        precomputed = {}
        for share in shares:
            self._prefill_share(share)
            if share.owner == share.rank:
                precomputed[share.req_id] = len(share.token_ids)
        self._set_step_max(max_rank_tokens)
        if sched_out.overlapped:     # a verify step built from the unresolved one's device state
            launched = self.rt.runner.launch_overlapped(sched_out, self.in_flight[-1])
        else:
            launched = self.rt.runner.launch(sched_out, precomputed)
        if max_rank_tokens == 0:
            return                                   # no forward anywhere: nothing to resolve
        if launched is None:
            self.rt.runner.idle_step()
        if self.parallel.recorder is not None:
            self.parallel.recorder.end_step()
        self.in_flight.append(launched)

    def _overlap_state(self) -> tuple:
        """(must resolve before the next schedule, req_id -> drafts or None, launched a step) of this rank's
        newest launched step (the executor's overlap questions; spec/overlap.py)."""
        step = self.in_flight[-1] if self.in_flight else None
        runner = self.rt.runner
        return runner.must_resolve_before_next(step), runner.overlap_drafts(step), step is not None

    def _set_step_max(self, max_rank_tokens: int | None) -> None:
        self.parallel.set_step_tokens(max_rank_tokens)
        if self.rt.runner.lockstep is not None:
            self.rt.runner.lockstep.max_rank_tokens = max_rank_tokens or 0

    def _prefill_share(self, share) -> None:
        """This rank's rows of a balanced-CP prefill (every rank runs the same layers' collectives); with
        DSpark, the prefix's last ring_len positions' draft inputs gathered and absorbed by the owner."""
        import torch

        from deepinfer.kernels.batch_invariant import batch_invariant_mode

        from .cp import draft_ring_tail, prefill_share
        self._set_step_max(share.split.max_rows)
        proposer = self.rt.runner.proposer
        with batch_invariant_mode(self.rt.runner.batch_invariant):
            hidden = prefill_share(self.rt.model, self.rt.caches, share, self.parallel.group, self.rt.runner.images)
            if proposer is not None:
                if hidden is None:
                    raise RuntimeError("speculative decoding needs the checkpoint's DSpark layers")
                rows, pos = draft_ring_tail(hidden, share, self.rt.caches.ring_len, self.parallel.group)
                if share.owner == share.rank:
                    n = len(share.token_ids)
                    proposer.absorb(rows, torch.from_numpy(pos).to(rows.device), [share.ring_slot], [0, len(pos)],
                                    max_pos=n)
        self.num_cp_prefills += 1

    def _rebalance(self) -> dict:
        from .eplb.weight_moves import rebalance_now
        res = rebalance_now(self.rt.model, self.parallel)
        self.num_rebalances += 1
        self.num_moved += res["num_moved"]
        return res

    def _score(self, jobs: list, num_prompts: int, opts: dict) -> list[dict]:
        """deepinfer-score on this rank's share of the prompts (its model holds only its experts). A
        rank with fewer prompts than the largest share runs idle forwards for the missing ones so
        every MoE collective has all ranks (1 prefill + decode_steps forwards per prompt)."""
        import torch

        from deepinfer.cli.score import score_prompt
        self.parallel.set_step_tokens(None)
        out = [score_prompt(self.rt.model, ids, opts["steps"], forced, opts["dump_hidden"], opts["dspark"],
                            opts["draft_steps"], torch.device(self.rt.device)) for ids, forced in jobs]
        for _ in range((num_prompts - len(jobs)) * (1 + opts["steps"])):
            self.rt.model.idle_forward()
        return out

    def _gauges(self) -> dict:
        from deepinfer.model import host_tables
        d, g, lock = self.parallel.dispatcher, self.rt.runner.graphs, self.rt.runner.lockstep
        engrams = [layer.engram for layer in self.rt.model.layers if layer.engram is not None]
        return {"graph_steps": 0 if g is None else g.num_steps, "graph_replays": 0 if g is None else g.num_replays,
                "graph_padding_steps": 0 if g is None else g.num_padding_steps,
                "graph_verify_steps": 0 if g is None else g.num_verify_steps,
                "lockstep_eager_steps": 0 if lock is None else lock.num_eager_steps,
                "pid": os.getpid(), "num_rebalances": self.num_rebalances, "num_moved": self.num_moved,
                "num_cp_prefills": self.num_cp_prefills,
                "step_seconds": self.step_seconds, "num_steps": self.num_steps,
                "comm_seconds": getattr(d, "seconds", None),
                "engram_rows": [eg.embed.weight.shape[0] for eg in engrams],
                "engram_host_files": [host_tables.host_file_of(eg.embed.weight) for eg in engrams
                                      if getattr(eg.embed, "host", False)],
                **self._image_gauges()}

    def _image_gauges(self) -> dict:
        """Images encoded ahead (and their SM share), prompts held for the engine, images the runner
        had to encode inline in a step."""
        embeds = self.rt.runner.images
        if embeds is None:
            return {}
        enc = self.images.encoder if self.images is not None else None
        return {"images_encoded_ahead": 0 if enc is None else enc.num_encoded,
                "image_prompts_held": len(embeds.ahead), "images_encoded_inline": embeds.num_encoded,
                "vision_num_sms": None if enc is None else enc.num_sms}


if __name__ == "__main__":
    import sys
    main(int(sys.argv[1]))
