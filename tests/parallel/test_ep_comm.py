"""ep_comm: every backend's dispatch -> experts -> combine equals (torch.equal) the same experts run
on one rank with every slot local (the local backend on all ranks' data). 2 and 4 gloo processes,
spawned once per world size; every case runs inside the workers, results come back through files."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.conftest import free_port

from deepinfer.parallel.ep_comm import DISPATCHERS, LocalTokens, make_dispatcher

NUM_LOCAL, DIM, TOPK = 4, 16, 3
BACKENDS = ["allgather", "alltoall"]
CASES = ["random", "empty_rank", "one_slot", "redundant", "all_empty"]
MODES = ["given", "none"]             # max_tokens set by the driver, or found by the dispatcher
NUM_REPLICAS = 2                      # redundant case: the last 2 slots replicate logical experts 0, 1


# --- the data and the experts: deterministic, so workers and the reference build the same -------

def phys_to_log(case: str, num_slots: int) -> list[int]:
    """Logical expert of each physical slot (identity, but for the redundant case's replicas)."""
    if case != "redundant":
        return list(range(num_slots))
    n_log = num_slots - NUM_REPLICAS
    return list(range(n_log)) + list(range(NUM_REPLICAS))


def make_case(case: str, world_size: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per rank (x [T, d] bf16, topk_ids [T, K] physical slots, topk_weights [T, K] fp32)."""
    g = torch.Generator().manual_seed(CASES.index(case) * 10 + world_size)
    num_slots = world_size * NUM_LOCAL
    sizes = {"empty_rank": [4, 0, 6, 3], "all_empty": [0, 0, 0, 0]}.get(case, [5, 3, 7, 1])[:world_size]
    out = []
    for T in sizes:
        x = torch.randn(T, DIM, generator=g).to(torch.bfloat16)
        w = torch.rand(T, TOPK, generator=g)
        out.append((x, _route(case, T, num_slots, g), w))
    return out


def _route(case: str, T: int, num_slots: int, g) -> torch.Tensor:
    if case == "one_slot":                                   # every pair, even a token's K picks, on one slot
        return torch.full((T, TOPK), num_slots - 1, dtype=torch.long)
    if case != "redundant":
        return torch.rand(T, num_slots, generator=g).argsort(1)[:, :TOPK]
    # logical expert 0 picked by every token; logical 0 / 1 sent to their replica on odd (t + k)
    n_log = num_slots - NUM_REPLICAS
    logical = torch.cat([torch.zeros(T, 1, dtype=torch.long),
                         1 + torch.rand(T, n_log - 1, generator=g).argsort(1)[:, :TOPK - 1]], 1)
    odd = (torch.arange(T)[:, None] + torch.arange(TOPK)) % 2 == 1
    return torch.where(odd & (logical < NUM_REPLICAS), logical + n_log, logical)


def expert_params(logical: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + logical)
    return torch.randn(DIM, generator=g), torch.randn(DIM, generator=g)


def run_experts(lt: LocalTokens, rank: int, num_local: int, p2l: list[int]) -> torch.Tensor:
    """[P, d] bf16: per local slot an elementwise fp32 affine map times the routing weight (row-wise,
    so the bits do not depend on which rows are batched together)."""
    y = torch.empty(lt.pair_token.shape[0], lt.x.shape[1], dtype=torch.bfloat16)
    for e in lt.pair_expert.unique().tolist():
        sel = (lt.pair_expert == e).nonzero().squeeze(1)
        a, b = expert_params(p2l[rank * num_local + e])
        y[sel] = ((lt.x[lt.pair_token[sel]].float() * a + b) * lt.pair_weight[sel, None]).to(torch.bfloat16)
    return y


def run_experts_dense(x_all: torch.Tensor, local: torch.Tensor, w: torch.Tensor, rank: int, num_local: int,
                      p2l: list[int]) -> torch.Tensor:
    """[N*M, K, d] bf16: run_experts' map at each pick this rank holds (local < num_local), zeros elsewhere."""
    y = torch.zeros(*local.shape, x_all.shape[1], dtype=torch.bfloat16)
    for row, k in (local < num_local).nonzero().tolist():
        a, b = expert_params(p2l[rank * num_local + int(local[row, k])])
        y[row, k] = ((x_all[row].float() * a + b) * w[row, k]).to(torch.bfloat16)
    return y


def reference(data, p2l: list[int]) -> list[torch.Tensor]:
    """The local backend on every rank's tokens with every slot local, split back per rank."""
    x, ids, w = (torch.cat(parts) for parts in zip(*data))
    disp = make_dispatcher("local", len(p2l), 0, 1)
    lt, h = disp.dispatch(x, ids, w)
    out = disp.combine(run_experts(lt, 0, len(p2l), p2l), h)
    return list(out.split([d[0].shape[0] for d in data]))


# --- the workers ----------------------------------------------------------------------------------

def _worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=60))
    results = {}
    for case in CASES:
        data = make_case(case, world_size)
        p2l = phys_to_log(case, world_size * NUM_LOCAL)
        for backend in BACKENDS:
            for mode in MODES:
                disp = make_dispatcher(backend, NUM_LOCAL, rank, world_size)
                disp.max_tokens = max(d[0].shape[0] for d in data) if mode == "given" else None
                lt, h = disp.dispatch(*data[rank])
                out = disp.combine(run_experts(lt, rank, NUM_LOCAL, p2l), h)
                results[case, backend, mode] = (out, lt.x.shape[0], lt.pair_token.shape[0])
                if disp.dense:
                    M = disp.step_tokens(data[rank][0].shape[0], torch.device("cpu"))
                    x_all, local, w, h = disp.dispatch_dense(*data[rank], M)
                    live = int((local < NUM_LOCAL).sum())
                    out = disp.combine_dense(run_experts_dense(x_all, local, w, rank, NUM_LOCAL, p2l), h)
                    results[case, backend + "-dense", mode] = (out, x_all.shape[0], live)
    torch.save(results, f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module", params=[2, 4])
def world(request, tmp_path_factory):
    """(world_size, per rank {(case, backend, mode): (combined [T, K, d], rows received, pairs)})."""
    n = request.param
    out = tmp_path_factory.mktemp(f"ep{n}")
    mp.spawn(_worker, args=(n, free_port(), str(out)), nprocs=n, join=True)
    return n, [torch.load(out / f"rank{r}.pt") for r in range(n)]


# --- the tests ------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("backend", BACKENDS + ["allgather-dense"])
@pytest.mark.parametrize("case", CASES)
def test_matches_one_rank(world, case, backend, mode):
    n, results = world
    data = make_case(case, n)
    ref = reference(data, phys_to_log(case, n * NUM_LOCAL))
    for r in range(n):
        out, _, _ = results[r][case, backend, mode]
        assert out.shape == ref[r].shape and out.dtype == torch.bfloat16
        assert torch.equal(out, ref[r]), f"rank {r}"
    # every (token, pick) pair computed exactly once, somewhere
    assert sum(results[r][case, backend, mode][2] for r in range(n)) == sum(d[1].numel() for d in data)


@pytest.mark.parametrize("case", CASES)
def test_alltoall_sends_each_token_once_per_rank(world, case):
    n, results = world
    data = make_case(case, n)
    for r in range(n):
        want = sum(int(((ids // NUM_LOCAL) == r).any(1).sum()) for _, ids, _ in data)
        assert results[r][case, "alltoall", "none"][1] == want


def test_redundant_replicas_equal_logical_routing():
    """Sending a pair to a replica instead of the primary slot changes nothing: the same result as
    routing every pair by its logical expert."""
    n = 2
    data = make_case("redundant", n)
    p2l = phys_to_log("redundant", n * NUM_LOCAL)
    logical = [(x, torch.tensor(p2l)[ids], w) for x, ids, w in data]
    n_log = n * NUM_LOCAL - NUM_REPLICAS
    assert any(bool((ids >= n_log).any()) for _, ids, _ in data)        # replicas are in use
    for a, b in zip(reference(data, p2l), reference(logical, list(range(n_log)))):
        assert torch.equal(a, b)


def test_local_backend_is_identity_and_reshape():
    T, K, d, E = 5, 3, 8, 6
    x = torch.randn(T, d).to(torch.bfloat16)
    ids, w = torch.randint(0, E, (T, K)), torch.rand(T, K)
    disp = make_dispatcher("local", E, 0, 1)
    lt, h = disp.dispatch(x, ids, w)
    assert lt.x is x
    assert torch.equal(lt.pair_token, torch.arange(T).repeat_interleave(K))
    assert torch.equal(lt.pair_expert, ids.flatten()) and torch.equal(lt.pair_weight, w.flatten())
    y = torch.randn(T * K, d).to(torch.bfloat16)
    assert torch.equal(disp.combine(y, h), y.view(T, K, d))
    lt0, h0 = disp.dispatch(x[:0], ids[:0], w[:0])                      # T = 0
    assert disp.combine(torch.empty(0, d, dtype=torch.bfloat16), h0).shape == (0, K, d)
    with pytest.raises(ValueError):
        make_dispatcher("local", E, 0, 2)


def test_bad_backend_names_the_choices():
    with pytest.raises(ValueError) as e:
        make_dispatcher("deepep-nope", 4, 0, 2)
    for name in DISPATCHERS:
        assert name in str(e.value)
    assert {"local", "allgather", "alltoall"} <= set(DISPATCHERS)
