"""Decode and DSpark verify steps through CUDA graphs: the model runner's fast path.

A step in which every request runs exactly its last known token and its drafts (q_i = 1 + k_i
tokens at a start > 0; k_i = 0: a pure decode step) and that fits a captured (batch size, verified
length L) is padded to that key (VerifyKeys: the smallest batch >= n, the smallest L >= max q_i;
rows past a request's q_i are padding) and replayed. With DSpark the verify keys are packed by
default (EngineArgs.spec_packed_verify): key (b, q) is b requests of up to 1 + K tokens each in
b * q rows, each request's rows contiguous, so a step costs the rows it verifies (sum q_i, rounded
up to a captured b * q), not b x its longest request:

    rows = input_batch.decode_rows(...)                 # None: not a decode / verify step -> eager
    key = graphs.serves(n, max_position, max q_i, sum q_i)   # None: no captured key holds it -> eager
    host = input_batch.decode_inputs(rows, q, L)        # numpy: positions, ids, history, slots, tables
    DecodeStepBuffers.fill(pinned, **host)              # padded metadata, one int64 buffer (model side)
    static.copy_(pinned, non_blocking=True)             # one H2D copy
    static input_ids <- previous step's device samples  # async scheduling: tokens not known on the host
    graph.replay(); logits = static_logits[:n * L]      # (the runner gathers rows j < q_i)

The captured function is Transformer.forward on the static ForwardBatch / StepMetadata views
(model/step_metadata.py DecodeStepBuffers draws the layout and the padding rules); it returns the
logits of every row and, with DSpark, the draft blocks' input rows (main_hidden). Capture happens
once, at engine start (after the caches exist), largest L and size first into one memory pool, each
warmed up first so Triton compilation and allocator growth happen outside capture. With
speculative="dspark" the lengths are 1 .. num_speculative_tokens + 1 (verify_lengths). Without
CUDA (or with enabled=False) CudaGraphRunner calls the function eagerly on the same padded
buffers: the CPU tests of this path. DraftGraphs (below) does the same for the DSpark drafting
pass (greedy drafts; sampled drafts stay eager).
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from deepinfer.model.batch import ForwardBatch
from deepinfer.model.step_metadata import DecodeStepBuffers
from deepinfer.worker.cuda_graph import CudaGraphRunner

logger = logging.getLogger(__name__)

DEFAULT_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)
# positions past max_model_len an eager step may reach (drafts under verification): the rope tables
# are grown to cover them before capture, so no later step reallocates a table a graph reads
DRAFT_ROOM = 64


def graph_sizes(args, model_args, device: str) -> tuple[int, ...]:
    """Decode batch sizes to capture for EngineArgs `args`; () = eager only. Off for enforce_eager,
    batch_invariant on CUDA (row-by-row GEMMs) and the index-key alias emulation (per-sequence host-side
    key owners). cuda_graph_sizes None: DEFAULT_SIZES on CUDA, none on CPU; sizes given on a CPU run the
    padded step eagerly (a test mode; under batch_invariant row by row, so padding changes no bit)."""
    cuda = device.startswith("cuda")
    if args.enforce_eager or (args.batch_invariant and cuda) or model_args.emulate_index_k_alias:
        return ()
    sizes = args.cuda_graph_sizes
    if sizes is None:
        sizes = DEFAULT_SIZES if cuda else ()
    sizes = sorted(set(int(s) for s in sizes))
    if any(s < 1 for s in sizes):
        raise ValueError(f"cuda_graph_sizes must be >= 1, got {sizes}")
    holds_all = [s for s in sizes if s >= args.max_num_seqs][:1]          # none past the first that holds every request
    return tuple([s for s in sizes if s < args.max_num_seqs] + holds_all)


def verify_lengths(args) -> tuple[int, ...]:
    """Tokens per request of the captured steps: 1 (decode), and with DSpark 1 + k for every k the
    scheduler may verify (0 .. num_speculative_tokens)."""
    if args.speculative != "dspark":
        return (1,)
    return tuple(range(1, args.num_speculative_tokens + 2))


class VerifyKeys:
    """The captured (batch size, verified length) pairs and the one a step takes: among the pairs
    with batch >= n and length >= the step's longest q_i, the fewest rows (then the shorter length).
    max_tokens: verify pairs (L > 1) of more rows are not captured (the MoE's masked grouped form,
    the one a graph can hold, stops at MASKED_MAX_PAIRS token-expert pairs); decode (L = 1) keeps
    every size, as before.

    Packed verify graphs (`packed`, the default with DSpark): a verify pair (b, q) is the varlen
    step of b requests in b * q rows, each request up to the longest captured length (DecodeStepBuffers
    num_rows), so it holds any verify step of n <= b requests with sum q_i <= b * q: a step whose
    requests verify different numbers of drafts costs the rows it verifies, rounded up to a multiple
    of b, not b x its longest request."""

    def __init__(self, batch_sizes, lengths, max_tokens: int | None = None, packed: bool = False) -> None:
        self.batch_sizes = tuple(sorted(set(batch_sizes)))
        self.lengths = tuple(sorted(set(lengths)))
        self.packed = packed
        self.pairs = [(b, q) for q in self.lengths for b in self.batch_sizes
                      if q == 1 or max_tokens is None or b * q <= max_tokens]

    def key(self, n: int, length: int, rows: int | None = None) -> tuple[int, int] | None:
        """rows: the step's sum of q_i (packed verify pairs hold it in b * q rows); None: n * length."""
        if self.packed and length > 1:
            rows = n * length if rows is None else rows
            fits = [(b * q, b, q) for b, q in self.pairs if q > 1 and b >= n and b * q >= rows
                    and length <= self.lengths[-1]]            # ties: the fewer requests
            _, b, q = min(fits, default=(0, None, None))
        else:
            _, q, b = min([(b * q, q, b) for b, q in self.pairs if b >= n and q >= length], default=(0, None, None))
        return None if b is None else (b, q)

    def sizes(self, length: int) -> list[int]:
        return [b for b, q in self.pairs if q == length]

    def all(self) -> list[tuple[int, int]]:
        """Capture order: the largest length first, each from the largest batch down (one pool)."""
        return sorted(self.pairs, key=lambda p: (-p[1], -p[0]))


class DecodeGraphs:
    """The captured decode steps of one model + caches: `serves(n, max_position)` says whether a pure
    decode step of n requests takes a graph, `step(...)` runs it. max_len (the engine's
    max_seq_len_to_capture): the static step holds positions below it only (E = max_len // ratio
    entries per sequence: the indexer's work per step grows with it); longer sequences run eagerly."""

    def __init__(self, model, caches, input_batch, sizes, max_model_len: int, block_tokens: int, device,
                 enabled: bool | None = None, max_len: int | None = None, lengths: tuple[int, ...] = (1,),
                 packed: bool = False, before_forward=None, gathered_ranks: int = 1):
        self.model, self.caches, self.device = model, caches, torch.device(device)
        # rank workers (parallel/lockstep.py): told the padded step's rows before each forward (capture,
        # warm-up and CPU runs), the size the step's collectives gather from every rank
        self.before_forward = before_forward
        if caches.scratch_slot < 0:
            raise ValueError("CUDA-graph decode needs caches allocated with scratch=True")
        args = model.args
        self.max_pos = max_model_len + DRAFT_ROOM - 1       # rope tables cover every eager step too
        self.max_len = min(max_model_len, max_len or max_model_len)
        self._layout = dict(window=args.window_size, ring_len=caches.ring_len, max_model_len=self.max_len,
                            block_tokens=block_tokens,
                            max_blocks=min(input_batch.block_table.shape[1], -(-self.max_len // block_tokens)),
                            ngram_width=input_batch.ngram_width,
                            ratios=[r for r in args.compress_ratios[:args.n_layers] if r > 0],
                            scratch_slot=caches.scratch_slot, scratch_block=caches.scratch_block,
                            extra=("pending_src",), device=self.device)
        cuda = self.device.type == "cuda"
        on = cuda if enabled is None else enabled and cuda
        from deepinfer.model.moe import MASKED_MAX_PAIRS
        # gathered_ranks: a rank worker's MoE gathers every rank's rows (the fixed-shape EP form)
        self.keys = VerifyKeys(sizes, lengths,
                               max_tokens=MASKED_MAX_PAIRS // (max(args.n_activated_experts, 1) * gathered_ranks),
                               packed=packed)
        self.max_q = max(self.keys.lengths)           # a packed verify graph's longest request
        # one runner per verified length (the static buffers differ), one memory pool for all
        self.runners = {q: CudaGraphRunner(self._forward, self.keys.sizes(q), enabled=on)
                        for q in self.keys.lengths if self.keys.sizes(q)}
        self.graphs = self.runners[self.keys.lengths[0]]    # None once a capture failed: everything eager
        self._capture()
        self._host, self._host_free = self._host_buffers(cuda)
        self._next_host = 0
        self.num_steps = 0            # steps served (graph replays, or eager runs of the padded step)
        self.num_verify_steps = 0     # of them, steps with drafts (L > 1)
        self.num_padding_steps = 0    # of them, steps with no real row (padding_step)

    # construction ------------------------------------------------------------------------------
    def _capture(self) -> None:
        t0 = time.perf_counter()
        pool = None
        try:
            for q in sorted(self.runners, reverse=True):
                runner = self.runners[q]
                runner.pool = pool
                runner.capture(lambda bs, q=q: self._inputs(bs, q))
                pool = runner.pool
        except Exception:  # noqa: BLE001 - a step the graph cannot hold must not stop the engine
            logger.exception("CUDA graph capture failed: decode and verify steps stay eager")
            self.graphs = None
            return
        if self.graphs.enabled:
            logger.info("captured CUDA graphs for batch sizes %s x tokens per request %s (positions < %d) in %.1f s",
                        self.graphs.batch_sizes, self.keys.lengths, self.max_len, time.perf_counter() - t0)
        # a graph reads the rope tables it was captured with: they must never be reallocated
        self._rope_ptrs = self._rope_table_ptrs()

    def _inputs(self, bs: int, q: int = 1) -> tuple[DecodeStepBuffers]:
        """Static buffers of size bs x q holding an all-padding step (what warm-up and capture run)."""
        bufs = self.new_buffers(bs, q)
        self._fill_padding(bufs)
        return (bufs,)

    def _fill_padding(self, bufs: DecodeStepBuffers) -> None:
        host = np.zeros(bufs.numel, dtype=np.int64)
        bufs.fill(host, **self._no_rows())
        bufs.flat.copy_(torch.from_numpy(host))

    def _no_rows(self) -> dict[str, np.ndarray]:
        """DecodeStepBuffers.fill's arguments of a step with no real row."""
        empty = np.zeros(0, dtype=np.int64)
        return dict(positions=empty, input_ids=empty, ngram_history=np.zeros((0, self._layout["ngram_width"]),
                    dtype=np.int64), ring_slots=empty, block_tables=np.zeros((0, 0), dtype=np.int64), pending_src=empty)

    def padding_step(self, key: tuple[int, int]) -> None:
        """Replay key's step with no real row (a rank worker with no request while the others replay that
        size: parallel/lockstep.py); its writes go to the scratch slot and block, its outputs unread. The
        buffers are loaded as a real step's (pinned, no wait on the step in flight)."""
        bs, q = key
        runner = self.runners[q]
        self._load(runner.static_in[bs][0], self._no_rows())
        runner.run(bs)
        self.num_steps += 1
        self.num_verify_steps += q > 1
        self.num_padding_steps += 1

    def new_buffers(self, bs: int, q: int) -> DecodeStepBuffers:
        """The static buffers of key (bs, q): bs x q padded, or (packed verify) bs requests of up to
        max_q tokens in bs * q rows."""
        if self.keys.packed and q > 1:
            return DecodeStepBuffers(bs, **self._layout, tokens_per_seq=self.max_q, num_rows=bs * q)
        return DecodeStepBuffers(bs, **self._layout, tokens_per_seq=q)

    def _host_buffers(self, cuda: bool):
        """Two pinned host buffers used in turn, each with the event of its last H2D copy: with async
        scheduling the next step is filled while the device may not have read the previous one."""
        if self.graphs is None or not cuda:
            return None, None
        numel = max(r.static_in[bs][0].numel for r in self.runners.values() for bs in r.batch_sizes)
        host = [torch.zeros(numel, dtype=torch.int64, pin_memory=True) for _ in range(2)]
        return host, [None, None]

    def adopt_new_rope_tables(self) -> None:
        """Tables created after capture (the drafting graphs' "local" table, when no backbone layer
        has that kind) are not read by these graphs: record them, so serves() does not take their
        creation for a reallocation. A table that existed at capture keeps its recorded pointer."""
        if self.graphs is None:
            return
        now = self._rope_table_ptrs()
        self._rope_ptrs = {k: (p if p else now[k]) for k, p in self._rope_ptrs.items()}

    def _rope_table_ptrs(self) -> dict:
        return {k: t.table.data_ptr() if t.table is not None else 0 for k, t in self.model.rope.items()}

    # the step ----------------------------------------------------------------------------------
    def serves(self, n: int, max_position: int, length: int = 1, rows: int | None = None) -> tuple[int, int] | None:
        """The (batch size, tokens per request) key that holds n requests of up to `length` tokens
        each (`rows` in all) whose last ones sit at positions up to max_position; None (eager) when
        none does or the graphs are no longer valid."""
        if self.graphs is None or max_position >= self.max_len:
            return None
        key = self.keys.key(n, length, rows)
        if key is None:
            return None
        if self.graphs.enabled and self._rope_table_ptrs() != self._rope_ptrs:
            logger.warning("a rope table was reallocated after capture: CUDA graphs off, steps stay eager")
            self.graphs = None
            return None
        return key

    def step(self, host_inputs: dict[str, np.ndarray], prev_sampled: torch.Tensor | None,
             key: tuple[int, int] | None = None):
        """-> (ForwardBatch views of the n real sequences' rows, logits [rows, V] fp32, main_hidden
        [rows, .] | None, cu [n + 1]): views of the graph's static outputs, which the next step
        overwrites. Row cu_i + j is request i's token j (padding past its q_i; padded keys: cu_i = i * L)."""
        n = len(host_inputs["positions"])
        bs, q = key if key is not None else (self.graphs.padded(n), 1)
        runner = self.runners[q]
        bufs: DecodeStepBuffers = runner.static_in[bs][0]
        self._load(bufs, host_inputs)
        cu = bufs.row_offsets(host_inputs.get("num_tokens", np.ones(n, dtype=np.int64)))[:n + 1]
        if prev_sampled is not None and (host_inputs["pending_src"] >= 0).any():
            v = bufs.v                        # async decode (q = 1): the input token is the last step's sample
            src = v["pending_src"]
            v["input_ids"].copy_(torch.where(src >= 0, prev_sampled[src.clamp_min(0)], v["input_ids"]))
        logits, hidden = runner.run(bs)
        self.num_steps += 1
        self.num_verify_steps += q > 1
        t = int(cu[n])
        return bufs.forward_batch(n, rows=t), logits[:t], None if hidden is None else hidden[:t], cu

    def step_on_device(self, inputs: dict, key: tuple[int, int]):
        """step() of an overlapped verify step (spec/overlap.py): the static buffers filled on the device
        from `inputs` (DecodeStepBuffers.fill_on_device's arguments), no host fill, no H2D copy of
        the step. -> (the buffers, logits [B * L, V], main_hidden | None): static outputs."""
        bs, q = key
        runner = self.runners[q]
        bufs: DecodeStepBuffers = runner.static_in[bs][0]
        bufs.fill_on_device(**inputs)
        logits, hidden = runner.run(bs)
        self.num_steps += 1
        self.num_verify_steps += q > 1
        return bufs, logits, hidden

    @property
    def num_replays(self) -> int:
        return 0 if self.graphs is None else sum(r.num_replays for r in self.runners.values())

    def _load(self, bufs: DecodeStepBuffers, host_inputs: dict) -> None:
        """Host fill + one H2D copy (CPU: the fill writes the static buffer itself)."""
        if self._host is None:
            bufs.fill(bufs.flat.numpy(), **host_inputs)
            return
        i = self._next_host
        self._next_host ^= 1
        if self._host_free[i] is not None:
            self._host_free[i].synchronize()            # its previous copy has been read
        host = self._host[i][:bufs.numel]
        bufs.fill(host.numpy(), **host_inputs)
        bufs.flat.copy_(host, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        self._host_free[i] = ev

    def _forward(self, bufs: DecodeStepBuffers):
        """The captured function: ([B * L, V] fp32 logits, [B * L, .] DSpark input rows | None) of the
        padded step."""
        if self.before_forward is not None:
            self.before_forward(bufs)
        with torch.inference_mode():
            out = self.model(bufs.forward_batch(), self.caches, meta=bufs.metadata(self.max_pos))
            return out.logits, out.main_hidden


class DraftGraphs:
    """The DSpark drafting pass (greedy drafts) through CUDA graphs, one per captured batch size:
    dspark_propose on DraftStepBuffers (model/dspark.py), the draft ids and confidence logits its
    static outputs. Sampled drafts (spec_acceptance="sampled", T > 0) call the sampler per draft
    and stay eager. Without CUDA (enabled False) the padded pass runs eagerly (the CPU tests)."""

    def __init__(self, model, caches, sizes, max_pos: int, device, enabled: bool | None = None) -> None:
        from deepinfer.model.dspark import DraftStepBuffers
        self.model, self.caches, self.device = model, caches, torch.device(device)
        attn = model.mtp[0].attn
        self._layout = dict(window=attn.window, block=model.args.dspark_block_size, ring_len=caches.ring_len,
                            scratch_slot=caches.scratch_slot, max_pos=max_pos, device=self.device)
        self._buffers = DraftStepBuffers
        cuda = self.device.type == "cuda"
        self.graphs = CudaGraphRunner(self._forward, sizes, enabled=cuda if enabled is None else enabled and cuda)
        try:
            self.graphs.capture(lambda bs: (self._empty(bs),))
        except Exception:  # noqa: BLE001 - drafting stays eager, the engine keeps going
            logger.exception("CUDA graph capture of the DSpark drafting pass failed: it stays eager")
            self.graphs = None
        self.num_steps = 0

    def _empty(self, bs: int):
        bufs = self._buffers(bs, **self._layout)
        host = np.zeros(bufs.numel, dtype=np.int64)
        bufs.fill(host, [], [], [])
        bufs.flat.copy_(torch.from_numpy(host))
        return bufs

    def serves(self, n: int) -> bool:
        return self.graphs is not None and 0 < n <= self.graphs.max_batch_size

    def step(self, anchor_ids: list[int], positions: list[int], ring_slots: list[int]):
        """-> (draft ids [n, block], confidence logits [n, block]): copies of the static outputs."""
        n = len(positions)
        bs = self.graphs.padded(n)
        bufs = self.graphs.static_in[bs][0]
        host = np.empty(bufs.numel, dtype=np.int64)
        bufs.fill(host, anchor_ids, positions, ring_slots)
        bufs.flat.copy_(torch.from_numpy(host))      # synchronous H2D: the .tolist() after the replay syncs anyway
        ids, conf = self.graphs.run(bs)
        self.num_steps += 1
        return ids[:n].clone(), conf[:n].clone()

    def _forward(self, bufs):
        from deepinfer.model.dspark import dspark_propose
        with torch.inference_mode():
            out = dspark_propose(self.model, bufs.v["anchor_ids"], None, None, self.caches, static=bufs)
            return out.draft_ids, out.confidence
