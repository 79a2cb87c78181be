"""The model runner: SchedulerOutput -> device tensors -> model -> sampled tokens.

It holds the model, its caches and the persistent InputBatch; it decides nothing (which requests,
how many tokens, which blocks: all of that is in the SchedulerOutput). Per step:

    1. drop finished / preempted requests, add new ones, apply block-table diffs
    2. write draft tokens to verify after each request's last known token
    3. build the ForwardBatch (vectorized gathers, input_batch.py), run the model
    4. sample the logits rows (last token, or 1 + drafts for verification), accept drafts,
       apply teacher forcing, append the results to the InputBatch

Draft verification (greedy until the sampler's rejection sampling lands): logits rows r_0..r_k of
a request with drafts d_1..d_k give g_j = argmax(r_j); d_j is accepted while d_j == g_(j-1), and the
sampled list is g_0..g_a (a accepted drafts + 1 new token). The scheduler then lowers
num_computed_tokens by the k - a rejected positions and frees the blocks past them; the caches
need nothing else (addressed by absolute position).
"""

from __future__ import annotations

import numpy as np
import torch

from deepinfer.outputs import ModelRunnerOutput, SchedulerOutput
from deepinfer.worker.input_batch import InputBatch


def sample_greedy(logits: torch.Tensor) -> torch.Tensor:
    """[N, V] fp32 -> [N] int64. The one place the sampler plugs in."""
    return logits.argmax(dim=-1)


class ModelRunner:
    def __init__(self, model, caches, device: torch.device, max_num_seqs: int, max_model_len: int,
                 block_tokens: int, ngram_width: int = 3) -> None:
        self.model = model
        self.caches = caches
        self.device = torch.device(device)
        max_blocks = -(-(max_model_len + 16) // block_tokens)
        self.input_batch = InputBatch(max_num_seqs, max_model_len, max_blocks, ngram_width)

    def execute(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(sched_out)
        if sched_out.is_empty:
            return ModelRunnerOutput([], [])
        if sched_out.replays:
            raise NotImplementedError("SWA bounded replay (ReplayParams) is not executed yet")
        req_ids = list(sched_out.num_scheduled_tokens)
        q_lens = np.fromiter(sched_out.num_scheduled_tokens.values(), dtype=np.int64, count=len(req_ids))
        num_spec = np.zeros(len(req_ids), dtype=np.int64)
        for i, req_id in enumerate(req_ids):
            drafts = sched_out.spec_tokens.get(req_id)
            if drafts:
                self.input_batch.write_drafts(req_id, drafts)
                num_spec[i] = len(drafts)
        batch, rows, num_logits = self.input_batch.build(req_ids, q_lens, num_spec, self.device)
        with torch.inference_mode():
            logits = self.model(batch, self.caches).logits                 # [N, V] fp32
            sampled = sample_greedy(logits).cpu().numpy()                  # [N]
        per_req = self._accept(sampled, num_logits, num_spec, batch.input_ids, batch.logits_indices)
        per_req = self._apply_forcing(rows, num_logits, per_req)
        out_logits = self._gather_logits(req_ids, rows, num_logits, per_req, logits)
        active = num_logits > 0
        self.input_batch.append_tokens(rows[active], [s for s, a in zip(per_req, active) if a])
        return ModelRunnerOutput(req_ids, per_req, logits=out_logits)

    def _update_states(self, sched_out: SchedulerOutput) -> None:
        for req_id in sched_out.finished_req_ids | sched_out.preempted_req_ids:
            self.input_batch.remove(req_id)
        for new in sched_out.new_reqs:
            self.input_batch.add(new)
        for diff in sched_out.cached_reqs:
            self.input_batch.update(diff)

    @staticmethod
    def _accept(sampled: np.ndarray, num_logits: np.ndarray, num_spec: np.ndarray,
                input_ids: torch.Tensor, logits_indices: torch.Tensor) -> list[list[int]]:
        if not num_spec.any():  # no drafts: one token per request that reached its end
            it = iter(sampled.tolist())
            return [[next(it)] if n else [] for n in num_logits.tolist()]
        fed = input_ids.cpu().numpy()[logits_indices.cpu().numpy()]       # token at each logits row
        out, off = [], 0
        for n, k in zip(num_logits.tolist(), num_spec.tolist()):
            if n == 0:
                out.append([])
                continue
            g, drafts = sampled[off:off + n], fed[off + 1:off + n]
            a = 0
            while a < k and drafts[a] == g[a]:
                a += 1
            out.append(g[:a + 1].tolist())
            off += n
        return out

    def _apply_forcing(self, rows: np.ndarray, num_logits: np.ndarray, per_req: list[list[int]]) -> list[list[int]]:
        ib = self.input_batch
        if not ib.forced:
            return per_req
        for i, row in enumerate(rows.tolist()):
            forced = ib.forced.get(row)
            if forced is None or not per_req[i]:
                continue
            k = int(ib.num_tokens[row] - ib.num_prompt[row])  # index of the first new output token
            per_req[i] = [forced[k + j] if k + j < len(forced) else t for j, t in enumerate(per_req[i])]
        return per_req

    def _gather_logits(self, req_ids, rows, num_logits, per_req, logits) -> dict | None:
        ib = self.input_batch
        if not ib.return_logits:
            return None
        out, off = {}, 0
        for req_id, row, n, toks in zip(req_ids, rows.tolist(), num_logits.tolist(), per_req):
            if n and row in ib.return_logits:
                out[req_id] = logits[off:off + len(toks)].float().cpu().numpy()
            off += n
        return out
