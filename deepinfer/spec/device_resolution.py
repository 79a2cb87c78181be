"""Device-side resolution of a verify step: the accepted counts and what the next step reads,
computed with tensor ops on the step's own device (no host sync), from what the step sampled.

This is the first half of speculation under async scheduling with overlap (issue 19): a verify
step N leaves these tensors on the device, so step N+1 can take its input token, positions and
draft slots from them instead of from the host; the host reads them one step later (one copy
with the samples) to fix its bookkeeping. Layout of one request b with k_b drafts (n_b = 1 + k_b
logits rows at offset off_b of the step's samples g and fed tokens f):

    f[off_b]       = the last known token, f[off_b + 1 + j] = draft d_(j+1)
    g[off_b + j]   = the target's token after row j (seeded sample, or accept / residual token)
    a_b            = #leading j < k_b with d_(j+1) == g_j   (replayed: min(replayed_b, k_b))
    tokens_b       = d_1 .. d_a, g_a                         (= g_0 .. g_a when compared)
    next_pos_b     = start_b + q_b - k_b + a_b               (the position the anchor g_a is fed at)
    draft_pos_b    = next_pos_b + 1 .. next_pos_b + K        (the next proposal's slots)

A request with no logits row (a prompt chunk short of its end) has a_b = 0, no tokens and
next_pos_b = start_b + q_b. The plain-Python reference is ModelRunner._accept (tested equal).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from deepinfer.host_copy import to_device


@dataclass
class DeviceResolution:
    num_accepted: torch.Tensor   # [B] int64 accepted drafts a_b (0 without logits rows)
    num_tokens: torch.Tensor     # [B] int64 new tokens: a_b + 1, or 0 without logits rows
    tokens: torch.Tensor         # [B, L] int64 the new tokens, left-aligned, -1 past num_tokens
    anchor: torch.Tensor         # [B] int64 the last new token (the next step's input), -1 if none
    next_pos: torch.Tensor       # [B] int64 first position the next step runs

    def draft_positions(self, num_speculative_tokens: int) -> torch.Tensor:
        """[B, K] positions of the next proposal's drafts (after the anchor)."""
        k = torch.arange(1, num_speculative_tokens + 1, device=self.next_pos.device)
        return self.next_pos[:, None] + k

    def to_host(self) -> tuple[np.ndarray, np.ndarray]:
        """(num_tokens [B], tokens [B, L]) on the host: the one read the host does, a step later."""
        return self.num_tokens.cpu().numpy(), self.tokens.cpu().numpy()

    def per_request(self) -> list[list[int]]:
        """ModelRunner._accept's form: the new tokens of each request."""
        n, toks = self.to_host()
        return [toks[b, :int(c)].tolist() for b, c in enumerate(n.tolist())]


def resolve_on_device(sampled: torch.Tensor, fed: torch.Tensor | None, num_logits: np.ndarray,
                      num_spec: np.ndarray, start, q_lens: np.ndarray,
                      replayed: np.ndarray | None = None) -> DeviceResolution:
    """sampled [N] / fed [N] (device; fed None: no drafts, one row per sampling request): the step's
    tokens per logits row; num_logits, num_spec, start, q_lens [B] host arrays the launch already
    has (the step's shape, not its outcome; start is a device tensor in an overlapped step,
    spec/overlap.py); replayed [B] accepted lengths >= 0 that replace the comparison (benchmark
    mode), -1 = compare."""
    dev = sampled.device
    B = len(num_logits)
    n, k = to_device(num_logits, dev), to_device(num_spec, dev)
    L = max(int(np.max(num_logits)) if B else 1, 1)
    off = to_device(np.concatenate([[0], np.cumsum(num_logits)[:-1]]), dev)
    j = torch.arange(L, device=dev)
    valid = j[None, :] < n[:, None]                                          # [B, L] real logits rows
    idx = torch.where(valid, off[:, None] + j, torch.zeros_like(valid, dtype=torch.int64))
    g = sampled.to(torch.int64)[idx] if sampled.numel() else torch.zeros((B, L), dtype=torch.int64, device=dev)
    if fed is None:
        drafts = torch.full((B, L), -1, dtype=torch.int64, device=dev)
        a = torch.zeros(B, dtype=torch.int64, device=dev)
    else:
        # draft d_(j+1) sits at fed row off + 1 + j; rows past k_b are padding (never compared)
        has_draft = j[None, :] < k[:, None]
        didx = torch.where(has_draft, off[:, None] + 1 + j, torch.zeros_like(idx))
        drafts = torch.where(has_draft, fed.to(torch.int64)[didx], torch.full_like(idx, -1))
        match = (drafts == g) & has_draft
        a = torch.cumprod(match.to(torch.int64), dim=1).sum(dim=1)
        if replayed is not None:
            r = to_device(replayed, dev)
            a = torch.where(r >= 0, torch.minimum(r, k), a)
    a = torch.where(n > 0, a, torch.zeros_like(a))
    num_tokens = torch.where(n > 0, a + 1, torch.zeros_like(a))
    g_a = g.gather(1, a[:, None].clamp(max=L - 1))                          # [B, 1]
    tokens = torch.where(j[None, :] < a[:, None], drafts, g_a.expand(B, L))  # d_1..d_a then g_a
    tokens = torch.where(j[None, :] < num_tokens[:, None], tokens, torch.full_like(tokens, -1))
    anchor = torch.where(n > 0, g_a[:, 0], torch.full_like(a, -1))
    st, q = to_device(start, dev), to_device(q_lens, dev)
    next_pos = torch.where(n > 0, st + q - k + a, st + q)
    return DeviceResolution(a, num_tokens, tokens, anchor, next_pos)

