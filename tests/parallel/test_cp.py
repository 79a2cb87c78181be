"""Balanced context parallelism (deepinfer/parallel/cp.py): the mirror split, and long prompts
prefilled by every gloo rank at once (real processes, real torch.distributed) against the shared
fixtures' rules and against one rank, with the decode staying on the owner rank."""

from __future__ import annotations

import contextlib

import json

import numpy as np
import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.config import EngineArgs
from deepinfer.engine import Engine
from deepinfer.parallel.cp import MirrorSplit, causal_work
from deepinfer.parallel.dp_scheduler import BORROW_PREFIX
from tests.conftest import build_fixture
from tests.engine.test_engine_parity import check_copies, run_teacher_forced


# ---- the split (no processes) ---------------------------------------------------------------------
@pytest.mark.parametrize("cp", [2, 3, 4, 8])
@pytest.mark.parametrize("n", [8, 17, 64, 299, 694, 1000, 4097, 65535])
def test_mirror_split_covers_every_position_once_with_even_causal_work(n, cp):
    if n < 2 * cp:
        pytest.skip("the engine never splits fewer than 2*cp tokens")
    split = MirrorSplit(n, cp)
    C = split.chunk
    shares = [split.positions(r) for r in range(cp)]
    assert np.array_equal(np.sort(np.concatenate(shares)), np.arange(n))     # a partition of 0..n-1
    assert max(len(s) for s in shares) <= split.max_rows == 2 * C
    for r, (a, b) in enumerate(split.chunks(r) for r in range(cp)):      # chunk r and its mirror
        assert a[0] == r * n // (2 * cp) and b[0] == (2 * cp - 1 - r) * n // (2 * cp)
        assert C - 1 <= a[1] - a[0] <= C and C - 1 <= b[1] - b[0] <= C          # no empty chunk
    work = [causal_work(s) for s in shares]
    if n % (2 * cp) == 0:
        assert len(set(work)) == 1, work                                    # exactly even
    one_chunk = causal_work(np.arange(n - C, n))                            # the costliest chunk
    assert max(work) - min(work) <= one_chunk, (work, one_chunk)
    contiguous = [causal_work(np.arange(r * n // cp, (r + 1) * n // cp)) for r in range(cp)]
    if n >= 8 * cp:                                                         # what the mirror buys
        assert max(work) / min(work) < max(contiguous) / min(contiguous)
    order = split.gather_order()                                             # position -> gathered row
    gathered = np.full(cp * split.max_rows, -1)
    for r, s in enumerate(shares):
        gathered[r * split.max_rows: r * split.max_rows + len(s)] = s
    assert np.array_equal(gathered[order], np.arange(n))


def test_bad_cp_sizes_fail_at_start_with_one_clear_error():
    with pytest.raises(ValueError, match=r"context_parallel_size must be 1 \(off\) or equal data_parallel_size \(2\).*got 3"):
        EngineArgs(data_parallel_size=2, context_parallel_size=3)
    with pytest.raises(ValueError, match=r"equal data_parallel_size \(1\).*got 2"):
        EngineArgs(context_parallel_size=2)
    EngineArgs(data_parallel_size=2, context_parallel_size=2, speculative="dspark", max_num_batched_tokens=8192)
    with pytest.raises(ValueError, match="cp_min_prompt_tokens must be >= 1, got 0"):
        EngineArgs(data_parallel_size=2, context_parallel_size=2, cp_min_prompt_tokens=0)
    with pytest.raises(ValueError, match="cp_min_prompt_tokens=8192 exceeds max_num_batched_tokens=2048"):
        EngineArgs(data_parallel_size=2, context_parallel_size=2)        # the defaults: CP could never run
    EngineArgs(data_parallel_size=2, context_parallel_size=2, max_num_batched_tokens=8192)


# ---- the engine over gloo ranks -------------------------------------------------------------------
@pytest.mark.parametrize("fixture_name,ranks", [("v41-tiny-bf16", 2), ("v41-tiny", 4)])
def test_cp_prefill_passes_check_parity(fixture_name, ranks, tmp_path, tmp_path_factory):
    """16 teacher-forced requests; the 300- and 695-token prompts are prefilled with balanced CP
    (chunks of 38..174 tokens: window lists and compressor groups span ranks) while other ranks'
    requests decode; every copy's logits pass the fixture's rule."""
    ckpt = build_fixture(fixture_name, tmp_path_factory)
    expected = np.load(ckpt / "expected.npz")
    engine = Engine(EngineArgs(checkpoint=str(ckpt), device="cpu", max_num_seqs=8, max_num_batched_tokens=1024,
                               num_cache_blocks=8 * 13, data_parallel_size=ranks, context_parallel_size=ranks,
                               cp_min_prompt_tokens=256, worker_threads=1,
                               model_overrides={"emulate_index_k_alias": True}))
    try:
        logits = run_teacher_forced(engine, expected)
        cp = engine.scheduler.cp_prefills
        pings = engine.runner.ping()
        assert engine.kv_cache.num_used_blocks == 0                  # owners' and borrowed blocks all back
        engine.kv_cache.check()
    finally:
        engine.shutdown()
    assert len(cp) >= 4 and {n for _, _, n in cp} == {299, 694}, cp
    assert all(p["num_cp_prefills"] == len(cp) for p in pings)     # every rank ran its share of each
    check_copies(logits, expected, ckpt, tmp_path, f"16 requests over {ranks} ranks, long prompts with CP")


PROMPT_LENS = (695, 300, 145, 40, 18)


def _prompts(ckpt) -> list[list[int]]:
    """The fixture's prompts and a 40-token one (chunks of 5: shorter than a window, a ratio group
    split over ranks), longest first."""
    ids = [p["ids"] for p in json.loads((ckpt / "prompts.json").read_text())["prompts"]]
    ids.append(ids[3][100:140])
    return sorted(ids, key=len, reverse=True)


def _params(n: int) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=6, temperature=0.0 if i % 2 else 0.9, top_p=0.95, seed=5 + i,
                           ignore_eos=True) for i in range(n)]


@pytest.fixture(scope="module")
def one_rank_tokens(tmp_path_factory):
    import torch
    ckpt = build_fixture("v41-tiny", tmp_path_factory)
    prompts = _prompts(ckpt)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)             # as the rank workers run (OpenMP threads on a busy host stall)
    try:
        llm = LLM(str(ckpt), max_num_seqs=8, max_num_batched_tokens=1024, batch_invariant=True, device="cpu")
        return [o.token_ids for o in llm.generate(prompts, _params(len(prompts)))]
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("ranks,extra", [(2, {}), (4, {}), (2, {"expert_parallel": False, "async_scheduling": True})])
def test_cp_tokens_equal_one_rank_and_decode_stays_on_owner(ranks, extra, one_rank_tokens, tmp_path_factory):
    """batch_invariant: every prompt (18..695 tokens) prefilled with CP, one arriving per step while
    the earlier ones decode, gives one rank's tokens bit for bit (greedy and seeded sampling; EP on,
    and experts replicated with pipelined steps). After its CP step a request lives on its owner
    alone: the others hold no block of it and never schedule it."""
    ckpt = build_fixture("v41-tiny", tmp_path_factory)
    prompts, params = _prompts(ckpt), _params(len(PROMPT_LENS))
    engine = Engine(EngineArgs(checkpoint=str(ckpt), device="cpu", max_num_seqs=8, max_num_batched_tokens=1024,
                               batch_invariant=True, data_parallel_size=ranks, context_parallel_size=ranks,
                               cp_min_prompt_tokens=8, worker_threads=1, **extra))
    dps = engine.scheduler
    tokens: dict[str, list[int]] = {}
    seen_on: dict[str, set[int]] = {}
    try:
        def step():
            for o in engine.step():
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            for r, s in enumerate(dps.schedulers):
                for rid in s.requests:
                    seen_on.setdefault(rid, set()).add(r)
                for key in s.kv_cache.block_ids:        # a borrowed copy never outlives its step
                    assert not key.startswith(BORROW_PREFIX) or engine._in_flight is not None, key
        for i, ids in enumerate(prompts):
            engine.add_request(f"r{i}", ids, params[i])
            while not tokens.get(f"r{i}"):
                step()
            owner = next(o for rid, o, _ in dps.cp_prefills if rid == f"r{i}")
            assert dps.rank_of[f"r{i}"] == owner
            others = [s for r, s in enumerate(dps.schedulers) if r != owner]
            assert all(f"r{i}" not in s.kv_cache.block_ids for s in others)
        while engine.has_unfinished_requests():
            step()
        pings = engine.runner.ping()
        assert engine.kv_cache.num_used_blocks == 0
        engine.kv_cache.check()
    finally:
        engine.shutdown()
    assert [n for _, _, n in dps.cp_prefills] == [n - 1 for n in PROMPT_LENS]     # every prompt took CP
    assert all(len(seen_on[f"r{i}"]) == 1 for i in range(len(prompts))), seen_on  # scheduled by its owner only
    assert len({o for _, o, _ in dps.cp_prefills}) > 1                            # owners spread over ranks
    assert all(p["num_cp_prefills"] == len(prompts) for p in pings)
    assert [tokens[f"r{i}"] for i in range(len(prompts))] == one_rank_tokens


def run_recording_drafts(engine, prompts, params, images=None) -> tuple[list[list[int]], dict[str, list]]:
    """Every prompt (with its images, if given) added at once, stepped to the end: (tokens per request, per
    request each proposal (tokens so far, drafts) its scheduler's DraftBook held after a step)."""
    tokens: dict[str, list[int]] = {}
    drafts: dict[str, list] = {}
    scheds = getattr(engine.scheduler, "schedulers", [engine.scheduler])
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", ids, params[i], images=None if images is None else images[i])
    while engine.has_unfinished_requests():
        for o in engine.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
        for s in scheds:
            for rid in s.requests:
                if s.draft_book.pending(rid):
                    drafts.setdefault(rid, []).append((len(tokens.get(rid, [])), tuple(s.draft_book.pending(rid))))
    return [tokens[f"r{i}"] for i in range(len(prompts))], drafts


def test_cp_with_dspark_gives_one_ranks_tokens_and_drafts(one_rank_tokens, tmp_path_factory):
    """DSpark with balanced CP over 2 ranks (batch_invariant, every draft verified): the owner's draft rings
    get the prefix's last ring rows from the ranks that prefilled them (draft_ring_tail), so the tokens are
    one rank's without speculation and every draft block proposed is the one a 1-rank DSpark run proposes
    at the same point (the drafts read the rings: without the tail's rows they differ)."""
    import torch
    ckpt = build_fixture("v41-tiny", tmp_path_factory)
    prompts, params = _prompts(ckpt)[:3], _params(3)
    kw = dict(checkpoint=str(ckpt), max_num_seqs=8, max_num_batched_tokens=1024, batch_invariant=True, device="cpu",
              speculative="dspark", spec_policy="threshold", spec_confidence_threshold=0.0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    ref = Engine(EngineArgs(**kw))
    try:
        want, want_drafts = run_recording_drafts(ref, prompts, params)
    finally:
        ref.shutdown()
        torch.set_num_threads(threads)
    engine = Engine(EngineArgs(**kw, data_parallel_size=2, context_parallel_size=2, cp_min_prompt_tokens=8,
                               worker_threads=1))
    try:
        got, got_drafts = run_recording_drafts(engine, prompts, params)
        cp = engine.scheduler.cp_prefills
    finally:
        engine.shutdown()
    assert sorted(n for _, _, n in cp) == sorted(len(p) - 1 for p in prompts)     # every prompt took CP
    assert want == got == one_rank_tokens[:3]
    assert set(want_drafts) == set(got_drafts) == {"r0", "r1", "r2"}
    for rid in want_drafts:
        assert got_drafts[rid] == want_drafts[rid], rid


def test_cp_with_prefix_caching_second_turn_hits_its_snapshot(tmp_path_factory):
    """Prefix caching on with CP over 2 ranks (batch_invariant): turn 1's 300-token prompt is prefilled with
    CP (its blocks registered and its window snapshot kept on the owner as after an ordinary prefill; the
    borrowed copies never enter the cache), gives one rank's tokens; turn 2 (turn 1 + its answer + 13 new
    tokens) is placed on that owner, hits the snapshot (no CP: it starts past 0) and gives a cold 1-rank
    run's tokens bit for bit."""
    import torch
    ckpt = build_fixture("v41-tiny", tmp_path_factory)
    p1 = _prompts(ckpt)[1]
    extra = [(37 * i) % 900 + 11 for i in range(13)]
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    kw = dict(max_num_seqs=4, max_num_batched_tokens=1024, batch_invariant=True, device="cpu")
    llm = LLM(str(ckpt), **kw, data_parallel_size=2, context_parallel_size=2, cp_min_prompt_tokens=64,
              enable_prefix_caching=True, worker_threads=1)
    try:
        t1 = llm.generate(p1, greedy)[0].token_ids
        p2 = p1 + t1 + extra
        hot = llm.generate(p2, greedy)[0]
        counters = llm.stats()["counters"]
        cp = llm.engine.scheduler.cp_prefills
        dps = llm.engine.scheduler
        llm.engine.kv_cache.check()
        assert all(not k.startswith(BORROW_PREFIX) for s in dps.schedulers for k in s.kv_cache.block_ids)
        assert dps.num_prefix_placements == 1                     # turn 2 went to turn 1's owner
    finally:
        llm.engine.shutdown()
    assert [(n) for _, _, n in cp] == [len(p1) - 1]               # turn 1 only took CP
    assert counters["prefix_cache_snapshot_hits_total"] == 1 and counters["prefix_cache_replayed_tokens_total"] == 0
    assert hot.num_cached_tokens == len(p1) + len(t1) - 1
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cold = LLM(str(ckpt), **kw)
        want1 = cold.generate(p1, greedy)[0].token_ids
        want2 = cold.generate(p2, greedy)[0].token_ids
    finally:
        torch.set_num_threads(threads)
    assert t1 == want1 and hot.token_ids == want2


# ---- the model hook, in process (one rank: the CP share is every position) -------------------------
@contextlib.contextmanager
def one_rank_group(device: str, backend: str):
    """A 1-rank process group on a free local port (CPU: one thread, as the rank workers run; OpenMP threads on a
    busy host stall), destroyed and the thread count restored after."""
    import socket

    import torch
    import torch.distributed as dist
    threads = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(threads)


def cp_share_matches_plain_prefill(ckpt, device: str, backend: str) -> None:
    """prefill_share over a 1-rank group (its rows: both mirror chunks = every position, through the
    CP metadata, the per-layer gathers and the two-chunk Engram history) leaves exactly the caches a
    plain prefill leaves, the DSpark draft rings included (the plain prefill's rows absorbed against
    draft_ring_tail's), and the prompt's last token then gets the same logits from both."""
    import torch

    from deepinfer.model.batch import ForwardBatch
    from deepinfer.model.dspark import dspark_absorb
    from deepinfer.model.loader import load_model
    from deepinfer.parallel.cp import CPShare, draft_ring_tail, prefill_share
    from deepinfer.worker.loading import allocate_caches
    tokens = np.asarray(_prompts(ckpt)[1], dtype=np.int64)                      # 300 tokens
    n = len(tokens) - 1
    with one_rank_group(device, backend):
        model = load_model(ckpt, device, progress=False)
        width = model.args.engram_max_ngram_size - 1
        blocks, slot = list(range(5)), 1
        caches = [allocate_caches(model.args, 2, 6, 64, device, "bfloat16") for _ in range(2)]
        dev = torch.device(device)

        def batch(start: int, ids: np.ndarray) -> ForwardBatch:
            hist = [tokens[p] if p >= 0 else -1 for p in range(start - width, start)]
            return ForwardBatch(input_ids=torch.from_numpy(ids).to(dev),
                                positions=torch.arange(start, start + len(ids), device=dev),
                                cu_seqlens=torch.tensor([0, len(ids)]), start_pos=torch.tensor([start]),
                                ngram_history=torch.tensor([hist], device=dev), ring_slots=torch.tensor([slot], device=dev),
                                block_tables=torch.tensor([blocks], device=dev),
                                logits_indices=torch.tensor([len(ids) - 1], device=dev))
        with torch.inference_mode():
            plain = model(batch(0, tokens[:n]), caches[0]).main_hidden
            share = CPShare("r", 0, 0, 1, tokens[:n], blocks, slot)
            hidden = prefill_share(model, caches[1], share)
            rows, pos = draft_ring_tail(hidden, share, caches[1].ring_len, None)
            lo = n - caches[1].ring_len
            assert lo > 0 and np.array_equal(pos, np.arange(lo, n)) and torch.equal(rows, plain[lo:])
            for c, h in ((caches[0], plain[lo:]), (caches[1], rows)):     # same rows, same row count: same bits
                dspark_absorb(model, h, torch.from_numpy(pos).to(dev), [slot], [0, len(pos)], c)
            drafts = [m.layer_id for m in model.mtp]
            assert drafts and all(caches[0].window_kv[i].any() for i in drafts)   # the rings were written
            for kind in ("window_kv", "carry_kv", "carry_score", "compressed_kv", "index_k"):
                a, b = getattr(caches[0], kind), getattr(caches[1], kind)
                for key in (range(len(a)) if isinstance(a, list) else a):
                    assert torch.equal(a[key], b[key]), (kind, key)
            last = [model(batch(n, tokens[n:]), c).logits for c in caches]
        assert torch.equal(last[0], last[1])


def test_cp_share_matches_plain_prefill_on_cpu(tmp_path_factory):
    cp_share_matches_plain_prefill(build_fixture("v41-tiny", tmp_path_factory), "cpu", "gloo")
