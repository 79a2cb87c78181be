"""Lossless acceptance of drafts: the two rules, on the target's filtered distributions.

A request verifying drafts d_1..d_k runs k+1 logits rows; row j gives p_j, the target's filtered
distribution (temperature, top-k/p, min-p, penalties, grammar) of the token after d_j, at the
absolute position pos_j = P + j + 1 (P: the request's last known token, d_0 = that token):

    fed:      t_P   d_1   d_2  ...  d_k
    rows:     p_0   p_1   p_2  ...  p_k          row j decides the token at pos_j

Rule "identical" (EngineArgs.spec_acceptance="identical", and every request at temperature 0):
    drafts are greedy; g_j = the seeded sample of p_j (SAMPLE stream at pos_j); accept d_(j+1)
    while d_(j+1) == g_j, emit g_0..g_a. Every emitted token is the one plain decoding draws at that
    position, so the tokens equal a run without drafts whatever was drafted and verified. It is
    speculative sampling with a point-mass draft q = onehot(d): accept with min(1, p(d)/1) = p(d),
    residual norm(max(0, p - q)) = p without d.
Rule "sampled" (spec_acceptance="sampled", requests at temperature > 0):
    drafts are sampled from q_j, the draft's distribution under the same temperature / top-k / top-p /
    min-p (DRAFT stream at the draft's position). Accept d_(j+1) iff u * q(d) < p_j(d), u from the
    ACCEPT stream at pos_j (probability min(1, p/q)); at the first rejection emit a token of
    norm(max(0, p_j - q_(j+1))) (RESIDUAL stream) and stop; all accepted: the bonus from p_k (SAMPLE).
    Each emitted token is distributed as p exactly (Leviathan et al. 2023, Chen et al. 2023); the
    acceptance is sum_v min(p, q) per draft instead of p(d_greedy), higher at temperature > 0.

Both rules come out as one token t_j per row, so the runner's prefix comparison (accept while the
fed d_(j+1) == t_j) serves both: under "sampled", t_j = d_(j+1) when accepted, else the residual
token, never d_(j+1) (a rejection needs p(d) < q(d), where the residual is 0).

Seeded determinism (random.py: every draw is a pure function of (seed, purpose, position)):
  * identical: the tokens are those of plain decoding with the same seed, independent of the
    batch, preemption, the drafts and how many of them the scheduler verified.
  * sampled: the tokens are a function of (seed, the drafts' logits, the verified counts). With the
    same verified counts (a static threshold, or the same batch) a rerun gives the same tokens; a
    different verification budget consults other streams at a position (ACCEPT/RESIDUAL instead of
    SAMPLE), so the tokens differ from plain decoding and between budgets while keeping the
    target distribution.
"""

from __future__ import annotations

import torch

from deepinfer.sample.sampler import inverse_cdf, row_totals


def speculative_rows(probs: torch.Tensor, draft_ids: torch.Tensor, draft_probs: torch.Tensor,
                     u_accept: torch.Tensor, u_residual: torch.Tensor) -> torch.Tensor:
    """The "sampled" rule on m rows that each verify one draft.

    probs [m, V] fp32: the target's filtered probabilities (not necessarily normalized);
    draft_ids [m] int64, sampled from draft_probs [m, V] (normalized, q(d) > 0);
    u_accept, u_residual [m] float64 in [0, 1). -> [m] int64: d where accepted, else a residual token.
    """
    dev = probs.device
    p = probs / row_totals(probs).to(probs.dtype)[:, None]                            # [m, V]
    d = draft_ids.to(dev)[:, None]
    q = draft_probs.to(dev, torch.float32)
    p_d, q_d = p.gather(1, d)[:, 0].double(), q.gather(1, d)[:, 0].double()
    accept = u_accept.to(dev) * q_d < p_d                                             # P = min(1, p/q)
    residual = (p - q).clamp_(min=0.0)                                                # [m, V]
    empty = row_totals(residual) <= 0                                                 # p == q: never rejected
    residual = torch.where(empty[:, None], p, residual)                               # no host read
    resampled = inverse_cdf(residual, u_residual.to(dev))
    return torch.where(accept, d[:, 0], resampled)
