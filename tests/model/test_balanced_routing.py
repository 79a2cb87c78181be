"""EngineArgs.dummy_routing="balanced" (model/balanced_routing.py): an engine on dummy weights routes every
MoE gate's picks so each expert is read once before any twice (the main layers and DSpark's draft blocks),
the routing weights stay the gate's own, and the setting is refused where it would override real weights."""

from __future__ import annotations

import json

import pytest
import torch

from deepinfer.config import EngineArgs
from deepinfer.model import balanced_routing
from deepinfer.model.moe import MoE


def _moe_picks(model, run) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{MoE module name: (weights, indices)} of the gates' last calls while run() runs."""
    seen, hooks = {}, []
    for name, m in model.named_modules():
        if isinstance(m, MoE):
            hooks.append(m.gate.register_forward_hook(lambda mod, i, out, name=name: seen.__setitem__(name, out)))
    try:
        run()
    finally:
        for h in hooks:
            h.remove()
    return seen


def test_engine_with_balanced_dummy_routing(tmp_path):
    from deepinfer import LLM, SamplingParams
    from deepinfer.checkpoint.generator import hf_config, text_config
    (tmp_path / "config.json").write_text(json.dumps(hf_config(text_config("tiny"))))
    llm = LLM(str(tmp_path), load_format="dummy", dummy_routing="balanced", device="cpu", max_num_seqs=4,
              num_cache_blocks=64, max_model_len=512)
    model = llm.engine.model
    prompts = [[0, 5, 6, 7] * 8, [0, 9, 11]]
    picks = _moe_picks(model, lambda: llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0,
                                                                              ignore_eos=True)))
    assert picks, "no MoE gate ran"
    for name, (weights, indices) in picks.items():
        E, (T, k) = dict(model.named_modules())[name].gate.weight.shape[0], indices.shape
        counts = torch.bincount(indices.flatten(), minlength=E)
        assert int(counts.max() - counts.min()) <= 1, (name, counts)          # each expert once before any twice
        assert torch.equal(indices, (torch.arange(T * k).view(T, k) % E).to(indices.dtype)), name
        assert torch.isfinite(weights).all() and weights.shape == (T, k)


def test_rank_workers_route_balanced(tmp_path):
    """Two gloo rank workers (attention data parallel, experts split) on dummy weights with balanced picks:
    each rank installs its hooks at its own offset and the engine serves both requests to the end."""
    from deepinfer import LLM, SamplingParams
    from deepinfer.checkpoint.generator import hf_config, text_config
    (tmp_path / "config.json").write_text(json.dumps(hf_config(text_config("tiny"))))
    llm = LLM(str(tmp_path), load_format="dummy", dummy_routing="balanced", device="cpu", data_parallel_size=2,
              worker_threads=1, max_num_seqs=4, num_cache_blocks=64, max_model_len=512)
    try:
        outs = llm.generate([[0, 5, 6, 7] * 8, [0, 9, 11]], SamplingParams(max_tokens=4, temperature=0.0,
                                                                           ignore_eos=True))
        assert [len(o.token_ids) for o in outs] == [4, 4]
    finally:
        llm.engine.shutdown()


def test_install_covers_every_gate_and_undoes(tiny_checkpoint):
    """The gates' own picks come back once the hooks are removed; the weights are the gates' own either way."""
    from deepinfer.model.loader import load_model
    model = load_model(tiny_checkpoint, progress=False)
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    x = torch.randn(7, model.args.dim).bfloat16()
    own = [m.gate(x, None) for m in moes]
    handles = balanced_routing.install(model)
    assert len(handles) == len(moes)
    for m, (w_own, i_own) in zip(moes, own):
        w, i = m.gate(x, None)
        E, k = m.gate.weight.shape[0], m.gate.topk
        assert torch.equal(w, w_own)
        assert torch.equal(i, (torch.arange(7 * k).view(7, k) % E).to(i.dtype))
    for h in handles:
        h.remove()
    for m, (w_own, i_own) in zip(moes, own):
        assert torch.equal(m.gate(x, None)[1], i_own)


def test_ranks_start_on_their_own_share(tiny_checkpoint):
    """Rank r of w starts its picks at expert r E / w: small steps on every data-parallel rank together still
    spread over the experts instead of all landing on the first ones."""
    from deepinfer.model.loader import load_model
    model = load_model(tiny_checkpoint, progress=False)
    moe = next(m for m in model.modules() if isinstance(m, MoE))
    E, k = moe.gate.weight.shape[0], moe.gate.topk
    x = torch.randn(1, model.args.dim).bfloat16()
    seen = []
    for rank in range(2):
        handles = balanced_routing.install(model, rank, 2)
        seen.append(moe.gate(x, None)[1])
        for h in handles:
            h.remove()
    for rank, picks in enumerate(seen):
        assert torch.equal(picks[0], (torch.arange(k) + rank * E // 2) % E)
    assert not set(seen[0].flatten().tolist()) & set(seen[1].flatten().tolist())


def test_balanced_routing_needs_dummy_weights(tmp_path):
    with pytest.raises(ValueError, match="only with load_format='dummy'"):
        EngineArgs(checkpoint=str(tmp_path), dummy_routing="balanced")
    with pytest.raises(ValueError, match="dummy_routing must be"):
        EngineArgs(checkpoint=str(tmp_path), load_format="dummy", dummy_routing="uniform")
