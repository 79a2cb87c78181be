"""DSpark proposer: after each verified step, feed the DSpark rings and draft the next tokens
(reference DSparkBlock; MODEL.md section 8.1). The runner calls it with tensors; it decides no
policy (how many drafts to verify is the scheduler's, spec/policy.py).

One request's positions after a step that ran q tokens from `start`, k of them drafts, a accepted:

    positions: start ........................ start+q-1
               | known tokens (q-k) | d_1 .. d_a | d_a+1 .. d_k |
               |<----- absorbed (q-k+a) ------->|  rejected: never absorbed
    anchor:    the token sampled after the last absorbed position p = start+q-k+a-1 (at p+1)
    drafts:    positions p+2 .. p+1+num_speculative_tokens

The rings are addressed by position (slot p % RING) and a draft row reads positions <= p only,
all of which this request absorbed (prefill chunks absorb every row), so rejected positions leave
nothing behind and a preempted request rebuilds its rings by recomputing from position 0.

Drafts are picked greedily (a point-mass draft distribution q = onehot(d)). For such a draft,
lossless speculative sampling accepts d with min(1, p(d)/q(d)) = p(d) and resamples at a rejection
from norm(max(0, p - q)) = p without d: exactly what the runner's verification does (sample g
from the target with the per-(seed, position) stream, accept d iff d == g). So temperature > 0
needs nothing else, and the tokens equal those of a run without drafts.

With `sampling` (spec_acceptance="sampled"), a request at temperature > 0 samples its drafts from
q = the draft logits under its temperature / top-k / top-p / min-p (DRAFT stream at the draft's
position) and gets q [k, V] back, which its verification needs (sample/rejection.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.model.dspark import dspark_absorb, dspark_propose
from deepinfer.sampling_params import SamplingParams


@dataclass
class DraftProposals:
    draft_ids: list[list[int]]         # per proposing request: num_speculative_tokens draft ids
    confidences: list[list[float]]     # per proposing request: confidence logits (pre-sigmoid), same length
    draft_probs: list[torch.Tensor | None] | None = None   # per request: q [k, V] fp32 of sampled drafts, None = greedy


class DSparkProposer:
    def __init__(self, model, caches, num_speculative_tokens: int = 5, acceptance: str = "identical",
                 replay_accepted_length: float | None = None, seed: int = 0,
                 replay_concentration: float = 2.0, replay_regime_tokens: int = 0) -> None:
        block = model.args.dspark_block_size
        if not block or not len(model.mtp):
            raise ValueError("speculative='dspark' needs a checkpoint with DSpark draft blocks "
                             "(dspark_block_size and num_nextn_predict_layers)")
        if not 1 <= num_speculative_tokens <= block:
            raise ValueError(f"num_speculative_tokens must be in [1, {block}] (the DSpark block), "
                             f"got {num_speculative_tokens}")
        self.model = model
        self.caches = caches
        self.num_speculative_tokens = num_speculative_tokens
        self.acceptance = acceptance     # "identical" | "sampled" (sample/rejection.py)
        self.replay = None               # benchmark mode: replayed confidences and outcomes (spec/replay.py)
        self.graphs = None               # worker/graph_step.py DraftGraphs: greedy drafting through CUDA graphs
        if replay_accepted_length is not None:
            from deepinfer.spec.replay import ReplayedAcceptance
            self.replay = ReplayedAcceptance(replay_accepted_length, num_speculative_tokens, replay_concentration,
                                             seed=seed, regime_tokens=replay_regime_tokens)

    def absorb(self, main_hidden: torch.Tensor, positions: torch.Tensor, ring_slots: list[int],
               cu_seqlens: list[int], max_pos: int | None = None) -> None:
        """main_hidden [T, k*dim] rows of accepted positions [T]; sequence i owns rows cu[i]:cu[i+1].
        max_pos: a bound on the positions (absorbing at launch must not read them back)."""
        if main_hidden.shape[0]:
            dspark_absorb(self.model, main_hidden, positions, ring_slots, cu_seqlens, self.caches, max_pos)

    def propose(self, anchor_ids: list[int], positions: list[int], ring_slots: list[int],
                sampling: list[tuple[SamplingParams, int] | None] | None = None) -> DraftProposals:
        """anchor_ids [B]: the token at p+1; positions [B]: p, the last absorbed position;
        sampling [B]: (params, seed) of a request whose drafts are sampled, None = greedy drafts."""
        if not anchor_ids:
            return DraftProposals([], [])
        k = self.num_speculative_tokens
        sampler = _DraftSampler(sampling, positions) if sampling and any(s is not None for s in sampling) else None
        if sampler is None and self.graphs is not None and self.graphs.serves(len(anchor_ids)):
            draft_ids, conf = self.graphs.step(anchor_ids, positions, ring_slots)
            return DraftProposals(draft_ids[:, :k].tolist(), conf[:, :k].float().tolist())
        dev = self.caches.window_kv[0].device
        ids = torch.tensor(anchor_ids, dtype=torch.int64, device=dev)
        out = dspark_propose(self.model, ids, positions, ring_slots, self.caches, sample=sampler)
        probs = sampler.draft_probs(k) if sampler is not None else None
        return DraftProposals(out.draft_ids[:, :k].tolist(), out.confidence[:, :k].float().tolist(), probs)


class _DraftSampler:
    """dspark_propose's `sample` callback: draft i of each row (position p+2+i), greedy or sampled."""

    def __init__(self, sampling: list[tuple[SamplingParams, int] | None], positions) -> None:
        """positions [B]: p per row, a host list, or a device tensor (drafting on the device at launch,
        spec/overlap.py: the DRAFT stream is then mixed on the device, sample/device_sampling.py)."""
        self.idx = [b for b, s in enumerate(sampling) if s is not None]
        self.params = [sampling[b][0] for b in self.idx]
        self.seeds = [sampling[b][1] for b in self.idx]
        if isinstance(positions, torch.Tensor):
            from deepinfer.host_copy import host_tensor
            self.positions = positions[host_tensor(self.idx, torch.int64, positions.device)]
        else:
            self.positions = [positions[b] for b in self.idx]
        self.num_rows = len(sampling)
        self.q: list[torch.Tensor] = []              # per draft i: [len(idx), V] normalized

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:          # [B, V] -> [B]
        from deepinfer.host_copy import host_tensor
        from deepinfer.sample.device_sampling import uniforms_on_device
        from deepinfer.sample.random import DRAFT, uniforms
        from deepinfer.sample.sampler import filtered_probs, inverse_cdf, row_totals
        i = len(self.q)
        out = logits.argmax(-1)
        sel = host_tensor(self.idx, torch.int64, logits.device)
        on_device = isinstance(self.positions, torch.Tensor) and logits.device.type == "cuda"
        probs = filtered_probs(logits[sel].float(), self.params, no_host_read=on_device)
        q = probs / row_totals(probs).to(probs.dtype)[:, None]
        if isinstance(self.positions, torch.Tensor):
            u = uniforms_on_device(self.seeds, self.positions + 2 + i, DRAFT)
        else:
            u = uniforms(self.seeds, [p + 2 + i for p in self.positions], DRAFT)
        out[sel] = inverse_cdf(q, u.to(q.device))
        self.q.append(q)
        return out

    def draft_probs(self, k: int) -> list[torch.Tensor | None]:
        res: list[torch.Tensor | None] = [None] * self.num_rows
        stacked = torch.stack(self.q[:k], dim=1)                          # [len(idx), k, V]
        for j, b in enumerate(self.idx):
            res[b] = stacked[j]
        return res
