"""The expert-parallel MoE's fixed-shape path (MoE._ep_dense: the allgather dispatcher's dispatch_dense /
combine_dense, other ranks' picks dropped by the masked form's routing): no host read, fixed shapes, the
path a graph-captured decode step needs. 2 and 3 gloo ranks, each with its own token count (one with none),
every MoE layer of the tiny preset on FP8 stacks with the masked form: the same bits as one rank holding
every expert, the pair-list path never taken and no host read (max_tokens set as the driver sets it); without
the masked form the pair list (its nonzero a host read), same bits."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.conftest import free_port

SIZES = [5, 0, 3]           # tokens per rank (rank 1 idle)
# (name, tokens x, MoE.masked): the masked form forced (a CPU runs it only so), at decode and prefill sizes;
# off: the pair list
RUNS = [("decode", 1, True), ("long", 40, True), ("off", 1, False)]


def _worker(rank: int, world_size: int, port: int, ckpt: str, out_dir: str) -> None:
    import deepinfer.model.moe as moe_mod
    from deepinfer.model.args import ModelArgs
    from deepinfer.model.loader import load_model
    from deepinfer.parallel.placement import ExpertPlacement
    from deepinfer.parallel.state import ParallelState
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=120))
    args = ModelArgs.from_checkpoint(ckpt)
    # 3 ranks: redundant slots make the count divide (replicas hold the same weights: the same bits)
    placement = ExpertPlacement.initial(args.n_layers, args.n_routed_experts, -args.n_routed_experts % world_size,
                                        world_size)
    ps = ParallelState(rank=rank, world_size=world_size, placement=placement)
    ep = load_model(ckpt, progress=False, parallel=ps, weight_format="fp8", moe_masked=True)
    one = load_model(ckpt, progress=False, weight_format="fp8", moe_masked=True)
    taken = {"dense": 0, "pairs": 0}
    real_dense, real_pairs = moe_mod.MoE._ep_dense, moe_mod.MoE._local_pairs

    def dense(self, *a):
        out = real_dense(self, *a)
        taken["dense"] += out is not None
        return out

    def pairs(self, *a):
        taken["pairs"] += 1
        return real_pairs(self, *a)
    moe_mod.MoE._ep_dense, moe_mod.MoE._local_pairs = dense, pairs
    results = {}
    from tests.model.test_moe_masked import _host_reads
    with torch.inference_mode():
        for run, scale, masked in RUNS:
            g = torch.Generator().manual_seed(100 * scale + rank)
            T = SIZES[rank] * scale
            ps.dispatcher.max_tokens = max(SIZES[:world_size]) * scale     # as the driver sets it
            reads = []
            for i, (le, lo) in enumerate(zip(ep.layers, one.layers)):
                le.ffn.masked = lo.ffn.masked = masked
                x = torch.randn(T, args.dim, generator=g).bfloat16()
                got = []
                reads += _host_reads(lambda: got.append(le.ffn(x)))
                results[run, i] = (got[0], lo.ffn(x))
            results[run, "taken"] = dict(taken, reads=reads)
            taken.update(dense=0, pairs=0)
    torch.save(results, f"{out_dir}/rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module", params=[2, 3])
def world(request, tiny_checkpoint, tmp_path_factory):
    n = request.param
    out = tmp_path_factory.mktemp(f"epdense{n}")
    mp.spawn(_worker, args=(n, free_port(), str(tiny_checkpoint), str(out)), nprocs=n, join=True)
    return n, [torch.load(out / f"rank{r}.pt") for r in range(n)]


@pytest.mark.parametrize("run", [r[0] for r in RUNS])
def test_ep_moe_equals_one_rank(world, run):
    n, results = world
    scale = next(s for name, s, _ in RUNS if name == run)
    for r in range(n):
        layers = [k for k in results[r] if k[0] == run and k[1] != "taken"]
        assert layers
        for key in layers:
            got, want = results[r][key]
            assert got.shape == want.shape == (SIZES[r] * scale, want.shape[1])
            assert torch.equal(got, want), (r, key)
        taken = results[r][run, "taken"]
        if run == "off":                          # no masked form: the pair list, every layer (its nonzero)
            assert taken["dense"] == 0 and taken["pairs"] == len(layers), taken
            assert "aten::nonzero" in taken["reads"], taken
        else:                                     # the fixed-shape path, every layer, never the pair list,
            assert taken["dense"] == len(layers) and taken["pairs"] == 0, taken
            assert taken["reads"] == [], taken    # and no host read (what a CUDA graph needs)
