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
