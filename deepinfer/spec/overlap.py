"""Verify steps that overlap under async scheduling (issue 19): a request's step N+1 is built and
launched while its step N, which verifies drafts, is still unresolved. Everything N+1 reads that
depends on N's accepted counts comes from tensors N left on the device; the host learns the counts
one step later and only fixes its bookkeeping.

    launch(N)       forward, sample, resolve_on_device: anchor, next_pos, tokens   (device)
                    draft_on_device: every row of N into the DSpark rings, then propose
                    from (anchor, next_pos - 1) through the static drafting buffers (device)
    schedule(N+1)   spec/reservation.py's worst case: 1 + K' tokens, blocks through c + K'
    launch(N+1)     step_inputs: start = next_pos, ids = [anchor, drafts[:K']], Engram history =
                    the host's known tail + N's accepted tokens; DecodeStepBuffers.fill_on_device,
                    then the captured verify graph (CUDA) or the same static step run eagerly
    resolve(N)      one host copy: tokens, accepted counts, N's drafts (not re-planned: N+1 verifies them);
                    the scheduler trims the k - a rejected positions (every later one shifts down)

Rollback stays free: N's rejected rows were absorbed into the DSpark rings and written into the
backbone caches at positions past next_pos, which N+1 overwrites before anything reads them (a
draft row reads positions <= its anchor's). That needs ring_len >= the draft window + K + 1, so a
rejected row never lands on a slot a later proposal still reads (checked at start: ring_fits).

What may draft on the device, and so be followed by an overlapped step (can_draft_on_device):
every request of the step samples (no prompt chunk short of its end), by argmax or by a seeded
sample at temperature > 0 with top-k / top-p / min-p (sample/device_sampling.py: the positions of
the seeded streams, the drafts and, under spec_acceptance="sampled", the draft probabilities q come
from N's device tensors; the drafts of such requests are sampled on the device too), logprobs and
presence / frequency penalties included (logprobs_on_device, penalize_on_device), with no grammar (its
state is the host's), teacher forcing, returned logits or bounded replay. Requests with images overlap too:
an overlapped step's positions lie past the prompt (text), and the Engram look-back it starts from is the
host's (_history: image-span positions dead). Anything else is
resolved before the next schedule, as before. Replayed acceptance (benchmark mode, spec/replay.py) draws each
proposal's outcome by (request, anchor position): with overlap the runner draws every position a
request may reach when it is added (a device table by row and position), so a proposal made on the
device reads the same outcome the host would have drawn.
"""

from __future__ import annotations

import numpy as np
import torch

from deepinfer.host_copy import to_device
from deepinfer.spec.device_resolution import DeviceResolution


def ring_fits(model, caches, num_speculative_tokens: int) -> bool:
    """Rejected rows absorbed at launch never overwrite a ring slot a later proposal reads."""
    window = model.mtp[0].attn.window
    return caches.ring_len >= window + num_speculative_tokens + 1


def can_draft_on_device(input_batch, rows: np.ndarray, num_logits: np.ndarray) -> bool:
    from deepinfer.sample.device_sampling import device_samplable
    ib = input_batch
    row_set = set(rows.tolist())
    return (bool((num_logits > 0).all())
            and all(device_samplable(ib.params[r]) for r in rows[ib.needs_sampler[rows]].tolist())
            and not (row_set & set(ib.forced)) and not (row_set & ib.return_logits)
            and not ib._replaying(rows, ib.num_computed[rows]).any())


def step_inputs(input_batch, rows: np.ndarray, q_lens: np.ndarray, res: DeviceResolution,
                drafts: torch.Tensor, prev_index: np.ndarray,
                num_verified: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """DecodeStepBuffers.fill_on_device's arguments of an overlapped step: request i (InputBatch row
    rows[i], index prev_index[i] in step N) runs q_i = 1 + K'_i tokens, its anchor then its first K'_i
    drafts of N's proposal, from N's next_pos. Its Engram history (positions next_pos-h .. next_pos-1)
    is the host's known tokens before n_known, then N's accepted drafts: next_pos = n_known + a.
    num_verified [n] (device): the policy's k_i <= K'_i (spec/device_verify.py): q_i = 1 + k_i on
    the device, the layout keeps L = 1 + max K' (rows past q_i are padding)."""
    ib, dev = input_batch, drafts.device
    b = to_device(prev_index, dev)
    L = int(q_lens.max())
    q = to_device(q_lens, dev) if num_verified is None else 1 + num_verified
    ids = torch.cat([res.anchor[b][:, None], drafts[b]], dim=1)[:, :L]
    j = torch.arange(L, device=dev)
    ids = torch.where(j[None, :] < q[:, None], ids, 0)
    h = ib.ngram_width
    tail = to_device(ib._history(rows, ib.num_tokens[rows]), dev)                  # [n, h] known here
    ext = torch.cat([tail, res.tokens[b]], dim=1)                                   # [n, h + L_N]
    hist = ext.gather(1, res.num_accepted[b][:, None] + torch.arange(h, device=dev))
    return dict(start=res.next_pos[b], input_ids=ids, ngram_history=hist,
                ring_slots=to_device(ib.ring_slot[rows], dev),
                block_tables=to_device(np.ascontiguousarray(ib.block_table[rows]), dev), num_tokens=q)
