"""The expert-parallel MoE path and the dummy load on CUDA, on one GPU (the multi-GPU runs are their
own issue): a 1-rank placement with redundant experts routes every pick through LayerPlacement,
the local dispatcher, the pair-wise expert forms (masked FP8 stacks) and moe_combine over the pair
layout; the shared fixtures' rule must still pass, hidden states included."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from tests.conftest import SHARED, build_fixture, free_port, graph_replay_matches_eager

pytestmark = pytest.mark.gpu


def _ep_model(ckpt, num_redundant: int, **kw):
    from deepinfer.model.args import ModelArgs
    from deepinfer.model.loader import load_model
    from deepinfer.parallel.placement import ExpertPlacement
    from deepinfer.parallel.state import ParallelState
    args = ModelArgs.from_checkpoint(ckpt)
    placement = ExpertPlacement.initial(args.n_layers, args.n_routed_experts, num_redundant, 1)
    return load_model(ckpt, "cuda", progress=False, parallel=ParallelState(placement=placement), **kw)


@pytest.mark.parametrize("fixture_name", ["v41-tiny-bf16", "v41-tiny"])
def test_ep_path_on_cuda_passes_check_parity(fixture_name, tmp_path, tmp_path_factory):
    from deepinfer.cli.score import score_prompt
    ckpt = build_fixture(fixture_name, tmp_path_factory)
    expected = np.load(ckpt / "expected.npz")
    meta = json.loads(str(expected["meta_json"]))
    model = _ep_model(ckpt, num_redundant=2, emulate_index_k_alias="reference" in meta, moe_masked=True)
    assert all(len(layer.ffn.experts) == model.args.n_routed_experts + 2 for layer in model.layers)
    prompts = json.loads((ckpt / "prompts.json").read_text())["prompts"]
    out = {}
    for i, p in enumerate(prompts):
        forced = {"fed": expected[f"p{i}_fed_tokens"], "tokens": expected[f"p{i}_tokens"]}
        res = score_prompt(model, list(p["ids"]), 16, forced, True, True, meta.get("draft_logit_steps", [0, 15]),
                           torch.device("cuda"))
        out.update({f"p{i}_{k}": v for k, v in res.items()})
    out["meta_json"] = np.array(json.dumps({"format": "dsv41-parity-candidate/1", "engine": "deepinfer-ep1"}))
    path = tmp_path / "cand.npz"
    np.savez(path, **out)
    res = subprocess.run([sys.executable, str(SHARED / "tools" / "check-parity"), str(ckpt), str(path),
                          "--require-hidden"], capture_output=True, text=True)
    print(res.stdout.strip().splitlines()[-1])
    assert res.returncode == 0, res.stdout[-3000:]


@pytest.mark.parametrize("preset", ["small", "full-width-ep8"])
def test_dummy_load_generates_on_cuda(preset, tmp_path):
    """load_format="dummy": only config.json on disk, random release-format weights made on the GPU;
    the engine runs prefill and CUDA-graph decode on them with finite logits."""
    from deepinfer import LLM, SamplingParams
    from deepinfer.checkpoint.generator import hf_config, text_config
    (tmp_path / "config.json").write_text(json.dumps(hf_config(text_config(preset))))
    llm = LLM(str(tmp_path), load_format="dummy", max_num_seqs=4, num_cache_blocks=64, max_model_len=1024)
    outs = llm.generate([[0, 5, 6, 7] * 16, [0, 9]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                        return_logits=True)
    assert [len(o.token_ids) for o in outs] == [8, 8]
    assert all(np.isfinite(o.logits).all() for o in outs)


def test_dense_ep_moe_captures_in_a_graph(small_checkpoint):
    """The expert-parallel MoE's fixed-shape path (allgather dispatch_dense / combine_dense over a 1-rank
    NCCL group, the step's max_tokens set as the driver sets it) on the GPU: the same outputs as a model
    without expert parallelism (to the masked GEMMs' tile choice: the gathered slab is wider), no host
    read (it captures in a CUDA graph), and a replay with other tokens equals eager."""
    import datetime

    import torch.distributed as dist

    import deepinfer.model.moe as moe_mod
    from deepinfer.model.args import ModelArgs
    from deepinfer.model.loader import load_model
    from deepinfer.parallel.ep_comm import AllGatherDispatcher
    from deepinfer.parallel.placement import ExpertPlacement
    from deepinfer.parallel.state import ParallelState
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        args = ModelArgs.from_checkpoint(small_checkpoint)
        placement = ExpertPlacement.initial(args.n_layers, args.n_routed_experts, 0, 1)
        disp = AllGatherDispatcher(placement.num_local, 0, 1, None)
        ps = ParallelState(placement=placement, dispatcher=disp)
        ep = load_model(small_checkpoint, "cuda", progress=False, parallel=ps)
        plain = load_model(small_checkpoint, "cuda", progress=False)
        moe, ref = ep.layers[-1].ffn, plain.layers[-1].ffn
        assert moe.ep is not None and moe.stacks is not None
        T = 24
        disp.max_tokens = T
        calls = []
        real = moe_mod.MoE._ep_dense
        moe_mod.MoE._ep_dense = lambda self, *a: calls.append(1) or real(self, *a)
        try:
            x = torch.randn(T, args.dim, device="cuda").bfloat16()
            with torch.inference_mode():
                got, want = moe(x).float(), ref(x).float()
                assert calls and (got - want).abs().max() <= 2e-2 * want.abs().max()
                graph_replay_matches_eager(moe, x.clone(), torch.randn_like(x))
        finally:
            moe_mod.MoE._ep_dense = real
    finally:
        dist.destroy_process_group()


def test_lockstep_decode_step_captures_over_nccl(small_checkpoint):
    """A rank worker's captured decode step (parallel/lockstep.py) on the GPU, over a 1-rank NCCL group:
    the whole padded step with the expert-parallel MoE on the allgather dispatcher's fixed-shape form and
    the EPLB recorder captures; a replay gives the same logits and expert loads as the same padded step
    run eagerly, the loads count the real rows only, and an all-padding replay (an idle rank's) adds none."""
    import datetime

    import torch.distributed as dist

    from deepinfer.model.args import ModelArgs
    from deepinfer.model.loader import load_model
    from deepinfer.parallel.ep_comm import AllGatherDispatcher
    from deepinfer.parallel.eplb.recorder import ExpertLoadRecorder
    from deepinfer.parallel.lockstep import GraphLockstep, HostAgreement
    from deepinfer.parallel.placement import ExpertPlacement
    from deepinfer.parallel.state import ParallelState
    from deepinfer.worker.graph_step import DecodeGraphs
    from deepinfer.worker.input_batch import InputBatch
    from deepinfer.worker.loading import allocate_caches
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        args = ModelArgs.from_checkpoint(small_checkpoint)
        placement = ExpertPlacement.initial(args.n_layers, args.n_routed_experts, 0, 1)
        rec = ExpertLoadRecorder(args.n_layers, args.n_routed_experts, 4, device="cuda")
        ps = ParallelState(placement=placement, dispatcher=AllGatherDispatcher(placement.num_local, 0, 1, None),
                           recorder=rec)
        model = load_model(small_checkpoint, "cuda", progress=False, parallel=ps)
        caches = allocate_caches(model.args, 4, 16, 64, "cuda", "bfloat16", scratch=True)
        width = max(model.args.engram_max_ngram_size - 1, 0)
        ib = InputBatch(4, 1024, 16, width, window=caches.ring_len // 2)
        name = HostAgreement.create(1)
        lock = GraphLockstep(ps, HostAgreement(name, 0, 1, GraphLockstep.FIELDS))
        HostAgreement.unlink(name)            # attached: the mapping outlives the name
        graphs = DecodeGraphs(model, caches, ib, (2, 4), 1024, 64, "cuda", before_forward=lock.before_forward)
        assert graphs.graphs is not None and graphs.graphs.enabled, "capture failed (see the log)"
        n = 3
        host = dict(positions=np.array([5, 9, 17]), input_ids=np.array([3, 4, 5]),
                    ngram_history=np.full((n, width), 7), ring_slots=np.arange(n),
                    block_tables=np.arange(n)[:, None], pending_src=np.full(n, -1))
        rec._open.zero_()
        _, logits, _, _ = graphs.step(host, None, (4, 1))
        got, loads = logits.clone(), rec._open.clone()
        rec._open.zero_()
        with torch.inference_mode():
            want, _ = graphs._forward(graphs.runners[1].static_in[4][0])     # the same padded step, eagerly
        assert graphs.num_replays == 1
        assert torch.equal(got, want[:n])
        assert torch.equal(loads, rec._open)
        ep_layers = sum(layer.ffn.ep is not None for layer in model.layers)
        assert loads.sum().item() == n * args.n_activated_experts * ep_layers      # real rows only
        rec._open.zero_()
        graphs.padding_step((4, 1))
        assert graphs.num_replays == 2 and rec._open.sum().item() == 0
    finally:
        dist.destroy_process_group()
