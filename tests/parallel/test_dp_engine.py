"""The multi-rank engine on CPU: N gloo rank workers (real processes, real torch.distributed), attention
data parallel + MoE expert parallel, against the shared fixtures and against one rank."""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from deepinfer import EngineDeadError, LLM, SamplingParams
from deepinfer.async_engine import AsyncEngine
from deepinfer.config import EngineArgs
from deepinfer.engine import Engine
from deepinfer.parallel.placement import PlacementError
from tests.conftest import SHARED, build_fixture
from tests.engine.test_engine_parity import check_copies, run_teacher_forced

PROMPTS = [[0, 128803, 19923 + 7 * i, 128804, 128822] + list(range(100 + i, 100 + 3 * i)) for i in range(6)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:          # a zombie is gone too
        return f.read().split()[2] != "Z"


@pytest.mark.parametrize("fixture_name,ranks", [("v41-tiny-bf16", 2), ("v41-tiny", 2), ("v41-tiny", 4)])
def test_multi_rank_engine_passes_check_parity(fixture_name, ranks, tmp_path, tmp_path_factory):
    """16 teacher-forced requests (whole prompts, prompts chunked at 192 tokens, decode) spread over
    the ranks; every copy's logits pass the fixture's rule."""
    ckpt = build_fixture(fixture_name, tmp_path_factory)
    expected = np.load(ckpt / "expected.npz")
    engine = Engine(EngineArgs(checkpoint=str(ckpt), device="cpu", max_num_seqs=8, max_num_batched_tokens=192,
                               num_cache_blocks=8 * 13, data_parallel_size=ranks, worker_threads=1,
                               model_overrides={"emulate_index_k_alias": True}))
    try:
        logits = run_teacher_forced(engine, expected)
        assert engine.kv_cache.num_used_blocks == 0
        assert all(not s.requests for s in engine.scheduler.schedulers)
        check_copies(logits, expected, ckpt, tmp_path, f"16 requests over {ranks} ranks (DP + EP)")
    finally:
        engine.shutdown()


@pytest.mark.parametrize("fixture_name,ranks", [("v41-tiny-bf16", 2), ("v41-tiny", 4)])
def test_multi_rank_scorer_passes_check_parity_with_hidden_states(fixture_name, ranks, tmp_path, tmp_path_factory):
    """deepinfer-score on N ranks (each prompt's prefill, 16 decode steps, DSpark drafts and the
    residual stream entering every layer): check-parity --require-hidden."""
    ckpt = build_fixture(fixture_name, tmp_path_factory)
    out = tmp_path / "cand.npz"
    subprocess.run([sys.executable, "-m", "deepinfer.cli.score", "--checkpoint", str(ckpt), "--prompts",
                    str(ckpt / "prompts.json"), "--decode-steps", "16", "--teacher-force", str(ckpt / "expected.npz"),
                    "--dump-hidden", "--out", str(out), "--data-parallel-size", str(ranks), "--device", "cpu"],
                   check=True, capture_output=True)
    res = subprocess.run([sys.executable, str(SHARED / "tools" / "check-parity"), str(ckpt), str(out),
                          "--require-hidden"], capture_output=True, text=True)
    print(res.stdout.strip().splitlines()[-1])
    assert res.returncode == 0, res.stdout[-3000:]


@pytest.mark.parametrize("ranks,extra", [(2, {}), (4, {}), (2, {"engram_placement": "device"}),
                                         (2, {"engram_placement": "host"}),
                                         (2, {"async_scheduling": True}), (2, {"speculative": "dspark"})])
def test_batch_invariant_tokens_equal_one_rank(ranks, extra, tmp_path_factory):
    """Same seeds, same tokens, bit for bit: greedy and sampled requests, one rank vs N (Engram
    sharded, whole, or one copy in the node's host memory, pipelined steps, DSpark drafts verified on every rank)."""
    ckpt = build_fixture("v41-tiny", tmp_path_factory)
    params = [SamplingParams(max_tokens=12, temperature=0.0 if i % 2 else 0.9, top_p=0.95, seed=11 + i,
                             ignore_eos=True) for i in range(len(PROMPTS))]
    kw = dict(max_num_seqs=4, max_num_batched_tokens=8, batch_invariant=True, device="cpu")
    ref = LLM(str(ckpt), **kw).generate(PROMPTS, params)
    llm = LLM(str(ckpt), data_parallel_size=ranks, worker_threads=1, **kw, **extra)
    try:
        outs = llm.generate(PROMPTS, params)
        pings = llm.engine.runner.ping()
    finally:
        llm.engine.shutdown()
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    assert all(not s.requests for s in llm.engine.scheduler.schedulers)
    assert not llm.engine.scheduler.rank_of
    assert min(llm.engine.scheduler.generated) > 0                     # every rank served requests
    total = json.loads((ckpt / "config.json").read_text())["text_config"]["engram_num_embeddings"]
    rows = [p["engram_rows"] for p in pings]
    if extra.get("engram_placement") == "host":          # whole, one mapping of the same unlinked /dev/shm file
        files = [p["engram_host_files"] for p in pings]
        assert all(r == total for r in rows) and len(files[0]) == len(total)
        assert all(f == files[0] for f in files[1:])
        assert all(f.startswith("/dev/shm/deepinfer-engram-") and f.endswith("(deleted)") for f in files[0])
        assert len(set(files[0])) == len(total)
    elif extra.get("engram_placement") == "device":
        assert all(r == total for r in rows)
    else:                                                               # each rank holds a slice
        assert [sum(col) for col in zip(*rows)] == total and all(r < t for rr in rows for r, t in zip(rr, total))
    if "speculative" in extra:
        assert llm.stats()["counters"]["spec_draft_tokens_proposed_total"] > 0


def test_live_rebalance_changes_no_token(tmp_path_factory):
    """EPLB every few steps while generating (redundant experts, weights moved between ranks):
    the tokens equal one rank's under batch_invariant, and the placement did change."""
    ckpt = str(build_fixture("v41-tiny", tmp_path_factory))
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    kw = dict(max_num_seqs=6, batch_invariant=True, device="cpu")
    ref = LLM(ckpt, **kw).generate(PROMPTS, params)
    llm = LLM(ckpt, data_parallel_size=2, worker_threads=1, num_redundant_experts=2, enable_eplb=True,
              eplb_step_interval=4, eplb_window_size=4, **kw)
    try:
        outs = llm.generate(PROMPTS, params)
        pings = llm.engine.runner.ping()
    finally:
        llm.engine.shutdown()
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    assert all(p["num_rebalances"] >= 3 for p in pings), pings
    assert sum(p["num_moved"] for p in pings) > 0, pings


def test_a_killed_rank_fails_every_request_and_leaves_no_process(tmp_path_factory):
    ckpt = str(build_fixture("v41-tiny", tmp_path_factory))
    eng = AsyncEngine(EngineArgs(checkpoint=ckpt, device="cpu", max_num_seqs=4, data_parallel_size=2,
                                 worker_threads=1))
    pids = eng.engine.runner.pids
    finals, first_token = {}, threading.Event()

    def sink(rid):
        def on(out):
            if out.new_token_ids:
                first_token.set()
            if out.finished:
                finals[rid] = out
        return on
    for i in range(4):
        eng.add_request(f"r{i}", PROMPTS[i], SamplingParams(max_tokens=100000, ignore_eos=True), sink(f"r{i}"))
    try:
        assert first_token.wait(60)
        os.kill(pids[1], signal.SIGKILL)
        deadline = time.monotonic() + 60
        while len(finals) < 4 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert sorted(finals) == [f"r{i}" for i in range(4)], finals
        for out in finals.values():
            assert out.finish_reason == "error" and "rank 1" in out.error and "signal 9" in out.error, out
        assert "rank 1" in eng.engine.dead
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(p) for p in pids)
        with pytest.raises(EngineDeadError, match="rank 1"):
            eng.add_request("late", PROMPTS[0], SamplingParams(max_tokens=2), lambda out: None)
    finally:
        eng.shutdown()
        eng.engine.shutdown()


def test_parallel_sizes_that_do_not_divide_the_experts_fail_before_starting(tmp_path_factory):
    ckpt = str(build_fixture("v41-tiny", tmp_path_factory))
    before = _children()
    with pytest.raises(PlacementError, match=r"8 routed experts \+ 0 redundant .* data_parallel_size=3"):
        Engine(EngineArgs(checkpoint=ckpt, device="cpu", data_parallel_size=3))
    with pytest.raises(PlacementError, match=r"8 routed experts \+ 1 redundant .* data_parallel_size=2"):
        Engine(EngineArgs(checkpoint=ckpt, device="cpu", data_parallel_size=2, num_redundant_experts=1))
    # no process of these engines is left (an earlier test's child may still be exiting: only new ones count)
    assert not _children() - before


def test_more_ranks_than_gpus_fail_with_the_count():
    from deepinfer.model.args import ModelArgs
    from deepinfer.parallel.setup import check_parallel_args
    with pytest.raises(PlacementError, match="data_parallel_size=8 exceeds the 1 visible GPU"):
        check_parallel_args(EngineArgs(data_parallel_size=8), ModelArgs(n_routed_experts=384), num_devices=1)


def test_a_checkpoint_missing_a_ranks_expert_fails_naming_it(tmp_path, tmp_path_factory):
    from safetensors import safe_open
    from safetensors.torch import save_file

    from deepinfer.model.loader import CheckpointError
    src = build_fixture("v41-tiny", tmp_path_factory)
    ckpt = tmp_path / "ckpt"
    shutil.copytree(src, ckpt)
    gone = "layers.3.ffn.experts.6.w1.weight"           # held by rank 1 of 2
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    shard = ckpt / index["weight_map"].pop(gone)
    with safe_open(str(shard), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys() if k != gone}
    save_file(tensors, str(shard))
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    before, segments = _children(), _segments()
    with pytest.raises(CheckpointError, match=gone.replace(".", r"\.")):
        Engine(EngineArgs(checkpoint=str(ckpt), device="cpu", data_parallel_size=2, engram_placement="host"))
    assert _children() == before
    assert _segments() == segments          # its /dev/shm names went with the failed start (host tables too)


def _segments() -> set[str]:
    """This process's engines' /dev/shm names (lockstep agreements, host Engram tables)."""
    return set(glob.glob(f"/dev/shm/deepinfer-*-{os.getpid()}-*"))


def _children() -> set[int]:
    out = set()
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                out |= {int(p) for p in f.read().split() if _alive(int(p))}
        except FileNotFoundError:     # a thread that exited after the listing has no children to count
            continue
    return out


def test_prefix_caching_places_requests_on_the_rank_that_holds_their_prefix(tmp_path_factory):
    """Each rank keeps its own prefix cache; a conversation's second turn goes to the rank holding
    its first (where plain least-loaded placement would send it elsewhere) and hits the window
    snapshot there; two requests sent together with a new shared prefix land together. Under
    batch_invariant the tokens equal one rank's without the cache."""
    ckpt = str(build_fixture("v41-tiny", tmp_path_factory))
    kw = dict(device="cpu", max_num_seqs=4, max_num_batched_tokens=64, block_tokens=8, batch_invariant=True)
    short = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    p1 = PROMPTS[3] + list(range(300, 340))
    eng = Engine(EngineArgs(checkpoint=ckpt, data_parallel_size=2, worker_threads=1, enable_prefix_caching=True,
                            **kw))
    sched, done, tokens = eng.scheduler, {}, {}

    def run_until(*rids):
        while not all(r in done for r in rids):
            for out in eng.step():
                tokens[out.request_id] = tokens.get(out.request_id, []) + out.new_token_ids
                if out.finished:
                    done[out.request_id] = out

    try:
        eng.add_request("x", PROMPTS[0], long)
        eng.add_request("t1", p1, short)
        assert sched.rank_of == {"x": 0, "t1": 1}             # least loaded
        run_until("t1")
        eng.add_request("y", PROMPTS[1], long)                 # no prefix anywhere: least loaded, rank 1
        assert sched.rank_of["y"] == 1
        p2 = p1 + tokens["t1"] + list(range(500, 506))
        eng.add_request("t2", p2, short)                       # equal loads: least loaded would pick rank 0
        assert sched.rank_of["t2"] == 1 and sched.num_prefix_placements == 1
        shared = list(range(700, 724))
        eng.add_request("a", shared + [801, 802], short)
        eng.add_request("b", shared + [803, 804, 805], short)  # a's blocks are not cached yet: placed with a
        assert sched.rank_of["a"] == sched.rank_of["b"]
        run_until("x", "y", "t2", "a", "b")
        assert done["t2"].num_cached_tokens == len(p1) + len(tokens["t1"]) - 1   # the snapshot
        assert done["b"].num_cached_tokens == 24                # waited for a's blocks instead of computing them
        assert eng.stats.snapshot()["counters"]["prefix_cache_snapshot_hits_total"] == 1
        assert not sched.rank_of and not any(sched._placed_hashes)
    finally:
        eng.shutdown()
    ref = LLM(ckpt, **kw)
    for rid, prompt in (("t1", p1), ("t2", p2), ("a", shared + [801, 802]), ("b", shared + [803, 804, 805])):
        assert tokens[rid] == ref.generate([prompt], short)[0].token_ids, rid
