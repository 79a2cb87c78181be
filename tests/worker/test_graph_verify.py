"""The static (CUDA-graph) form of a DSpark verify step computes what the dynamic form computes.

1. model level (CPU): prompts of 5, 130 and 260 tokens prefilled, then 24 verify steps in which
   sequence i runs its last known token and k_i random drafts (q_i = 1 + k_i, varying per step),
   accepts a random prefix and rolls back the rest (the next step starts after the accepted ones):
   once with StepMetadata built per step and once through DecodeStepBuffers(tokens_per_seq=L),
   padded in batch and in verified length. Logits of the real rows and the caches bitwise equal.
2. the key of a step (graph_step.VerifyKeys): the smallest captured (batch, verified length) that
   holds it, and none past the largest.
3. engine level (CPU): DSpark with graphs "enabled" in eager-padded mode gives the eager engine's
   tokens; the verify steps went through the static form.
4. the drafting pass (CPU): dspark_propose on DraftStepBuffers (padded) equals the dynamic pass.
5. GPU (marked): verify steps and drafting passes replayed through CUDA graphs give tokens and
   logits bitwise equal to the same padded steps run eagerly.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deepinfer.cache.model_caches import ModelCaches
from deepinfer.kernels.batch_invariant import batch_invariant_mode
from deepinfer.model.simple import make_batch
from deepinfer.model.step_metadata import DecodeStepBuffers

from cache_views import owned_cache_tensors

pytestmark = pytest.mark.usefixtures("one_thread")

BT, MAX_LEN, SLOTS, L = 64, 512, 3, 6


def _hist(seq: list[int], ngram: int) -> list[int]:
    h = seq[-(ngram - 1):] if ngram > 1 else []
    return [-1] * (ngram - 1 - len(h)) + list(h)


def _plan(steps: int, n_seqs: int, vocab: int):
    """Per step and sequence: (verified tokens q <= L, their ids, accepted drafts a < q)."""
    rng = np.random.default_rng(3)
    out = []
    for _ in range(steps):
        row = []
        for _ in range(n_seqs):
            q = int(rng.integers(1, L + 1))
            row.append((q, rng.integers(3, vocab, size=q).tolist(), int(rng.integers(0, q))))
        out.append(row)
    return out


def _run(model, prompts, plan, static_batch: int | None, packed: bool = False):
    args = model.args
    ngram = args.engram_max_ngram_size
    per_seq = -(-(MAX_LEN + 16) // BT)
    tables = np.arange(len(prompts) * per_seq).reshape(per_seq, len(prompts)).T.copy()
    caches = ModelCaches.allocate(args, SLOTS, len(prompts) * per_seq, BT, scratch=True)
    slots = list(range(len(prompts)))
    seqs = [list(p) for p in prompts]
    model(make_batch([(s, 0, []) for s in seqs], slots, torch.from_numpy(tables), ngram, "cpu"), caches)
    for s in seqs:
        s.append(5)                          # each prompt's first sampled token: known, not yet in the caches
    bufs = None
    layout = dict(window=args.window_size, ring_len=caches.ring_len, max_model_len=MAX_LEN, block_tokens=BT,
                  max_blocks=per_seq + 2, ngram_width=ngram - 1, ratios=caches.ratios.values(),
                  scratch_slot=caches.scratch_slot, scratch_block=caches.scratch_block, tokens_per_seq=L)
    if static_batch is not None:
        bufs = DecodeStepBuffers(static_batch, **layout)
    logits = []
    with batch_invariant_mode(True):     # row-by-row GEMMs: padding rows cannot move the real rows' bits
        for step in plan:
            # the last known token is the first verified one: sequence s holds it as s[-1]
            feeds = [[s[-1]] + ids[1:q] for s, (q, ids, _) in zip(seqs, step)]
            if bufs is None:
                batch = make_batch([(f, len(s) - 1, s[:-1]) for f, s in zip(feeds, seqs)], slots,
                                   torch.from_numpy(tables), ngram, "cpu", logits="all")
                out = model(batch, caches).logits
            else:
                q = np.array([len(f) for f in feeds])
                if packed:       # the rows it verifies rounded up to a multiple of the batch (a varlen key)
                    rows = min(-(-int(q.sum()) // static_batch) * static_batch, static_batch * L)
                    bufs = DecodeStepBuffers(static_batch, **layout, num_rows=rows)
                ids = np.zeros((len(seqs), L), dtype=np.int64)
                for i, f in enumerate(feeds):
                    ids[i, :len(f)] = f
                bufs.fill(bufs.flat.numpy(), positions=[len(s) - 1 for s in seqs], input_ids=ids,
                          ngram_history=np.array([_hist(s[:-1], ngram) for s in seqs]), ring_slots=slots,
                          block_tables=tables, num_tokens=q)
                full = model(bufs.forward_batch(), caches, meta=bufs.metadata(MAX_LEN + 63)).logits
                cu = bufs.v["cu_seqlens"].numpy()
                idx = np.concatenate([cu[i] + np.arange(len(f)) for i, f in enumerate(feeds)])
                assert packed or (cu[:len(feeds)] == np.arange(len(feeds)) * L).all()
                out = full[torch.from_numpy(idx)]
            logits.append(out.clone())
            for s, f, (_, _, a) in zip(seqs, feeds, step):
                s.extend(f[1:1 + a] + [7 + a])      # a drafts accepted, then a new token (rollback of the rest)
    return logits, caches


def test_static_verify_metadata_matches_dynamic(tiny_model):
    """Verified lengths 1..6 per sequence and step, padded to L = 6 and batch 4."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, tiny_model.args.vocab_size, size=n).tolist() for n in (5, 130, 260)]
    plan = _plan(24, len(prompts), tiny_model.args.vocab_size)
    dyn, dyn_caches = _run(tiny_model, prompts, plan, None)
    sta, sta_caches = _run(tiny_model, prompts, plan, 4)
    for step, (a, b) in enumerate(zip(dyn, sta)):
        assert torch.equal(a, b), (step, (a - b).abs().max().item())
    for (name, a), (_, b) in zip(owned_cache_tensors(dyn_caches), owned_cache_tensors(sta_caches)):
        assert torch.equal(a, b), name


def test_packed_verify_step_matches_dynamic(tiny_model):
    """The varlen form (num_rows < B * L: each sequence's real rows packed, the spare rows at the
    tails) computes what the dynamic step computes: logits of the real rows and caches bitwise."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, tiny_model.args.vocab_size, size=n).tolist() for n in (5, 130, 260)]
    plan = _plan(16, len(prompts), tiny_model.args.vocab_size)
    dyn, dyn_caches = _run(tiny_model, prompts, plan, None)
    sta, sta_caches = _run(tiny_model, prompts, plan, 4, packed=True)
    for step, (a, b) in enumerate(zip(dyn, sta)):
        assert torch.equal(a, b), (step, (a - b).abs().max().item())
    for (name, a), (_, b) in zip(owned_cache_tensors(dyn_caches), owned_cache_tensors(sta_caches)):
        assert torch.equal(a, b), name


def test_padding_rows_fill_the_tails_from_the_back():
    from deepinfer.model.step_metadata import padding_rows
    rng = np.random.default_rng(0)
    for _ in range(200):
        B, L = int(rng.integers(1, 9)), int(rng.integers(1, 7))
        q = np.zeros(B, dtype=np.int64)
        n = int(rng.integers(0, B + 1))
        q[:n] = rng.integers(1, L + 1, size=n)
        T = int(rng.integers(max(int(q.sum()), 1), B * L + 1))
        e = padding_rows(q, L, T)
        assert (e >= 0).all() and (q + e <= L).all() and q.sum() + e.sum() == T
        full = np.nonzero(q + e == L)[0]           # the tails filled are the last ones
        partial = np.nonzero((e > 0) & (q + e < L))[0]
        assert len(partial) <= 1 and all(i > partial[0] for i in full if len(partial) and e[i] > 0)
        assert (padding_rows(q, L, B * L) == L - q).all()
        assert torch.equal(padding_rows(torch.from_numpy(q), L, T), torch.from_numpy(e))


def test_verify_buffers_padding_rows_are_inert():
    """Rows past q_i and padding sequences: no list entries, lens 0, writes to scratch only."""
    bufs = DecodeStepBuffers(3, window=8, ring_len=16, max_model_len=64, block_tokens=8, max_blocks=8,
                             ngram_width=2, ratios=[1, 2, 4], scratch_slot=5, scratch_block=9, tokens_per_seq=4)
    host = np.zeros(bufs.numel, dtype=np.int64)
    tables = np.array([[0, 1, 2, 3], [4, 5, 6, 7]])
    bufs.fill(host, positions=[10, 3], input_ids=[[1, 2, 3, 4], [5, 6, 0, 0]], ngram_history=np.ones((2, 2)),
              ring_slots=[0, 1], block_tables=tables, num_tokens=[4, 2])
    v = bufs.views(host)
    real = np.array([1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0], dtype=bool)
    assert (v["win_idx"][~real] == -1).all() and (v["lens4"][~real] == 0).all()
    assert (v["ring_write"][~real] // 16 == 5).all() and (v["ring_write"][real] // 16 != 5).all()
    assert v["positions"][:6].tolist() == [10, 11, 12, 13, 3, 4]
    assert v["cu_seqlens"].tolist() == [0, 4, 8, 12] and v["row_in_seq"][:6].tolist() == [0, 1, 2, 3, 0, 1]
    # the last key of each real row is its own fresh row (after B * Wr = 21 ring rows)
    assert v["win_idx"][:6, -1].tolist() == [21, 22, 23, 24, 25, 26]
    # ratio 4 (2 entries a block): sequence 0 (positions 10..13) closes entry 2 (8..11): block 1, row 2*1 + 0;
    # sequence 1 (3..4) entry 0 (0..3): block 4; sequence 2 is padding: scratch block 9
    assert v["rows4"].tolist() == [2, 8, 18]
    assert v["member_rows4"][0].tolist() == [-1, -1, 0, 1] and v["member_carry4"][0].tolist() == [8, 9, -1, -1]
    # ratio 2 (4 entries a block), 2 group slots a sequence: sequence 0 closes entries 5 and 6; sequence 1
    # closes entry 1 (positions 2, 3: 2 from the carry ring) but not entry 2 (position 5 is not run)
    assert v["rows2"].tolist()[:4] == [5, 6, 4 * 4 + 1, 9 * 4 + 3]
    assert v["member_rows2"][2].tolist() == [-1, 4] and v["member_carry2"][2].tolist() == [2, -1]
    assert v["member_rows2"][3].tolist() == [-1, -1]


# ---- graph keys -----------------------------------------------------------------------------------
def test_verify_keys_pick_the_smallest_captured_shape():
    from deepinfer.worker.graph_step import VerifyKeys
    keys = VerifyKeys(batch_sizes=(1, 2, 4, 8), lengths=(1, 2, 4, 6))
    assert keys.key(3, 1) == (4, 1)
    assert keys.key(1, 3) == (1, 4)
    assert keys.key(8, 6) == (8, 6)
    assert keys.key(9, 2) is None and keys.key(2, 7) is None
    assert keys.all() == [(b, n) for n in (6, 4, 2, 1) for b in (8, 4, 2, 1)]   # capture order: largest first
    capped = VerifyKeys(batch_sizes=(1, 2, 4, 8), lengths=(1, 2, 4, 6), max_tokens=16)
    assert capped.sizes(1) == [1, 2, 4, 8] and capped.sizes(4) == [1, 2, 4] and capped.sizes(6) == [1, 2]
    assert capped.key(3, 5) is None and capped.key(2, 5) == (2, 6) and capped.key(8, 2) == (8, 2)
    assert capped.key(5, 1) == (8, 1)


def test_packed_verify_keys_go_by_rows():
    """Packed: a verify pair (b, q) holds n <= b requests of any length up to the longest captured
    one in b * q rows; decode (length 1) keys are as before."""
    from deepinfer.worker.graph_step import VerifyKeys
    keys = VerifyKeys(batch_sizes=(1, 2, 4, 8), lengths=(1, 2, 3, 4, 5, 6), packed=True)
    assert keys.key(3, 1) == (4, 1)
    assert keys.key(4, 6, rows=4 * 6) == (4, 6)
    assert keys.key(4, 6, rows=9) == (4, 3)           # one request of 6 rows and three of 1: 12 rows, not 24
    assert keys.key(8, 6, rows=17) == (8, 3) and keys.key(8, 2, rows=16) == (8, 2)
    assert keys.key(1, 6) == (1, 6) and keys.key(2, 7, rows=8) is None and keys.key(9, 2, rows=18) is None
    capped = VerifyKeys(batch_sizes=(1, 2, 4, 8), lengths=(1, 2, 3, 4, 5, 6), max_tokens=16, packed=True)
    assert capped.key(8, 6, rows=16) == (8, 2) and capped.key(8, 6, rows=17) is None


def test_verify_lengths_from_args():
    from types import SimpleNamespace

    from deepinfer.config import EngineArgs
    from deepinfer.worker.graph_step import graph_sizes, verify_lengths
    margs = SimpleNamespace(emulate_index_k_alias=False)
    assert verify_lengths(EngineArgs()) == (1,)
    assert verify_lengths(EngineArgs(speculative="dspark")) == (1, 2, 3, 4, 5, 6)
    assert verify_lengths(EngineArgs(speculative="dspark", num_speculative_tokens=3)) == (1, 2, 3, 4)
    assert graph_sizes(EngineArgs(speculative="dspark", max_num_seqs=16), margs, "cuda") == (1, 2, 4, 8, 16)
    assert graph_sizes(EngineArgs(speculative="dspark", enforce_eager=True), margs, "cuda") == ()


# ---- the engine -----------------------------------------------------------------------------------
def _spec_engine_run(ckpt, **kw):
    from deepinfer import LLM, SamplingParams
    prompts = [list(range(3, 8)), list(range(100, 140)), list(range(200, 350))]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (20, 12, 16)]
    llm = LLM(str(ckpt), device=kw.pop("device", "cpu"), max_num_seqs=4, max_num_batched_tokens=256, block_tokens=8,
              num_cache_blocks=128, max_model_len=512, speculative="dspark", spec_policy="threshold",
              spec_confidence_threshold=0.0, **kw)
    return llm, llm.generate(prompts, params, return_logits=True)


def test_engine_verify_graph_path_matches_eager_cpu(tiny_checkpoint):
    """CudaGraphRunner without CUDA runs the padded static step eagerly: DSpark verify steps (every
    draft verified, most rejected) through the static form give the eager engine's tokens. The
    padded rows change the CPU GEMM blocking of the real rows (last bits, as any batch composition
    does), so the run uses one captured size per batch and verified length (no padding)."""
    ref_llm, ref = _spec_engine_run(tiny_checkpoint)
    llm, got = _spec_engine_run(tiny_checkpoint, cuda_graph_sizes=(1, 2, 3))
    graphs = llm.engine.runner.graphs
    assert graphs is not None and graphs.num_verify_steps > 0 and graphs.num_replays == 0
    assert llm.engine.runner.proposer.graphs.num_steps > 0          # the drafting pass, padded static form
    for g, r in zip(got, ref):
        assert g.token_ids == r.token_ids
        assert np.array_equal(g.logits, r.logits)
    c = llm.engine.stats.snapshot()["counters"]
    assert c["spec_draft_tokens_verified_total"] > c["spec_verify_steps_total"] > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_verify_cuda_graphs_match_eager_gpu(tiny_checkpoint, monkeypatch):
    """DSpark on CUDA with verify graphs (batch sizes 1, 2, 4 x verified lengths 1..6): graph
    replays happened, and tokens and logits are bitwise equal to the same padded steps run eagerly
    (CudaGraphRunner with enabled=False: capture, replay, static refill, draft rows and the DSpark
    taps are what differ)."""
    from deepinfer.worker import graph_step
    # the synchronous verify path (CUDA's default overlaps verify steps: tests/engine/test_spec_overlap.py)
    llm, got = _spec_engine_run(tiny_checkpoint, device="cuda", cuda_graph_sizes=(1, 2, 4), async_scheduling=False)
    graphs = llm.engine.runner.graphs
    assert graphs is not None and graphs.num_replays > 0 and graphs.num_verify_steps > 0, \
        "no verify CUDA graph replayed (capture failed? see the log)"
    drafts = llm.engine.runner.proposer.graphs
    assert drafts is not None and drafts.graphs is not None and drafts.graphs.num_replays > 0, \
        "no drafting-pass CUDA graph replayed (capture failed? see the log)"

    class EagerPadded(graph_step.CudaGraphRunner):
        def __init__(self, fn, sizes, enabled=None, **kw):
            super().__init__(fn, sizes, enabled=False, **kw)
    with monkeypatch.context() as m:
        m.setattr(graph_step, "CudaGraphRunner", EagerPadded)
        llm2, same = _spec_engine_run(tiny_checkpoint, device="cuda", cuda_graph_sizes=(1, 2, 4), async_scheduling=False)
    assert llm2.engine.runner.graphs.num_replays == 0 and llm2.engine.runner.graphs.num_verify_steps > 0
    for g, s in zip(got, same):
        assert g.token_ids == s.token_ids
        assert np.array_equal(g.logits, s.logits)


# ---- the drafting pass ----------------------------------------------------------------------------
def test_static_drafting_pass_matches_dynamic(tiny_model):
    """dspark_propose on DraftStepBuffers (padded to 4 sequences, lists W + block wide) gives the
    dynamic pass's drafts and confidence logits bitwise, for anchors before and past the window."""
    from deepinfer.model.dspark import DraftStepBuffers, dspark_absorb, dspark_propose
    args = tiny_model.args
    caches = ModelCaches.allocate(args, SLOTS, 64, BT, scratch=True)
    k = len(args.dspark_target_layer_ids) * args.dim
    lens = [6, 131, 300]
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(sum(lens), k, generator=gen).to(torch.bfloat16)
    pos = torch.cat([torch.arange(n) for n in lens])
    cu = np.concatenate([[0], np.cumsum(lens)]).tolist()
    dspark_absorb(tiny_model, hidden, pos, [0, 1, 2], cu, caches)
    anchors, p, slots = [11, 22, 33], [n - 1 for n in lens], [0, 1, 2]
    with batch_invariant_mode(True):
        dyn = dspark_propose(tiny_model, torch.tensor(anchors), p, slots, caches)
        bufs = DraftStepBuffers(4, window=tiny_model.mtp[0].attn.window, block=args.dspark_block_size,
                                ring_len=caches.ring_len, scratch_slot=caches.scratch_slot, max_pos=MAX_LEN + 63)
        bufs.fill(bufs.flat.numpy(), anchors, p, slots)
        sta = dspark_propose(tiny_model, bufs.v["anchor_ids"], None, None, caches, static=bufs)
    assert torch.equal(dyn.draft_ids, sta.draft_ids[:3])
    assert torch.equal(dyn.confidence, sta.confidence[:3])
    assert torch.equal(dyn.logits, sta.logits[:3])
