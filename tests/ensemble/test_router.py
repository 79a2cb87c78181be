"""The replica router: prefix locality, least-loaded fallback, imbalance override, health."""

from __future__ import annotations

import random

import pytest

from deepinfer.ensemble.router import ReplicaLoad, Router, chunk_hashes, parse_metrics


def conversations(num=64, prefixes=4, prefix_len=256, seed=0):
    rng = random.Random(seed)
    systems = [[rng.randrange(1000) for _ in range(prefix_len)] for _ in range(prefixes)]
    order = [i % prefixes for i in range(num)]
    rng.shuffle(order)                                  # arrivals in random order
    return [(p, systems[p] + [rng.randrange(1000) for _ in range(40)]) for p in order]


def locality(assign: list[tuple[int, str]], prefixes=4) -> float:
    """Mean over prefixes of the fraction of its requests on its most used replica."""
    fr = []
    for p in range(prefixes):
        names = [n for q, n in assign if q == p]
        fr.append(max(names.count(n) for n in set(names)) / len(names))
    return sum(fr) / len(fr)


def test_chunk_hashes_are_chained():
    a, b = chunk_hashes(list(range(10)), 4), chunk_hashes(list(range(8)) + [99, 98], 4)
    assert len(a) == 2 and a == b                      # only full chunks; the tail does not count
    assert chunk_hashes([1] * 4 + [2] * 4, 4)[1] != chunk_hashes([3] * 4 + [2] * 4, 4)[1]   # chained
    assert chunk_hashes("abcdefgh", 4) == chunk_hashes("abcdefghij", 4)


def test_prefix_policy_keeps_each_prefix_on_one_replica_and_spreads_prefixes():
    r = Router(["a", "b"], policy="prefix", chunk=64)
    assign = []
    for p, key in conversations():
        name = r.pick(key)
        assign.append((p, name))
        r.done(name)
    assert locality(assign) == 1.0
    assert {n for _, n in assign} == {"a", "b"}        # the 4 prefixes are not all on one replica
    rr = Router(["a", "b"], policy="round_robin")
    assign_rr = [(p, rr.pick(key)) for p, key in conversations()]
    assert locality(assign_rr) < 0.75


def test_least_loaded_without_a_match_and_imbalance_overrides_the_match():
    r = Router(["a", "b"], policy="prefix", chunk=4, balance_abs=4, balance_rel=1.5)
    key = list(range(16))
    first = r.pick(key)
    other = "b" if first == "a" else "a"
    r.update_load(first, ReplicaLoad(num_running=2))
    assert r.pick(key) == first                        # the match wins while loads are close
    r.update_load(first, ReplicaLoad(num_running=20, num_waiting=5))
    r.update_load(other, ReplicaLoad(num_running=1))
    assert r.pick(key) == other                        # far more loaded: least-loaded wins
    assert r.pick([999] * 16) == other                 # no match: the least loaded


def test_unhealthy_replicas_are_skipped_and_come_back():
    r = Router(["a", "b"], policy="least_loaded", max_failures=2)
    r.update_load("a", ReplicaLoad(healthy=False))
    r.report_failure("a")
    assert r.healthy() == ["b"]
    assert {r.pick([1, 2]) for _ in range(5)} == {"b"}
    assert r.pick([1, 2], exclude=["a"]) == "b"
    with pytest.raises(LookupError):
        r.pick([1, 2], exclude=["b"])
    r.update_load("a", ReplicaLoad())
    assert r.healthy() == ["a", "b"]


def test_parse_metrics_reads_the_deepinfer_gauges():
    text = "\n".join([
        "# HELP deepinfer_num_requests_running Requests in the running batch",
        'deepinfer_num_requests_running{model="deepinfer",version="1"} 3',
        'deepinfer_num_requests_waiting{model="deepinfer",version="1"} 2',
        'deepinfer_cache_usage{model="deepinfer",version="1"} 0.25',
        'deepinfer_rank_cache_usage{model="deepinfer",rank="0"} 0.5',
        'nv_inference_count{model="deepinfer"} 7',
    ])
    load = parse_metrics(text)
    assert (load.num_running, load.num_waiting, load.cache_usage, load.prefix_hit_rate) == (3, 2, 0.25, None)
    assert load.queue == 5


def test_replica_roles_keep_the_prefix_cache_on_prefill_replicas():
    """--engine-args '{"enable_prefix_caching": true}' with --roles prefill decode: the prefill replica
    caches prefixes (the router's prefix-aware pick pays), the decode replica, which pulls every prompt,
    does not (it would refuse to start)."""
    from deepinfer.config import EngineArgs
    from deepinfer.ensemble.replicas import role_engine_args
    args = {"enable_prefix_caching": True, "max_model_len": 256}
    prefill, decode = role_engine_args(args, "prefill"), role_engine_args(args, "decode")
    assert prefill == {**args, "kv_role": "prefill"} and role_engine_args(args, "both") == args
    assert decode == {**args, "kv_role": "decode", "enable_prefix_caching": False, "context_parallel_size": 1}
    for a in (prefill, decode):
        EngineArgs(checkpoint="unused", **a)                # both roles' args are valid
    # balanced CP stays with the prefill replicas too (a decode instance refuses it: nothing to split there)
    cp = {**args, "data_parallel_size": 2, "context_parallel_size": 2, "cp_min_prompt_tokens": 64}
    EngineArgs(checkpoint="unused", **role_engine_args(cp, "prefill"))
    EngineArgs(checkpoint="unused", **role_engine_args(cp, "decode"))
    with pytest.raises(ValueError, match="context_parallel_size"):
        EngineArgs(checkpoint="unused", **{**cp, "kv_role": "decode"})
