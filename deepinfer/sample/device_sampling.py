"""Seeded sampling whose positions, drafts and draft probabilities are device tensors (issue 19: verify
steps that overlap at temperature > 0, spec/overlap.py). The Sampler (sampler.py) reads positions and
drafts from the host; an overlapped step N+1 has them only on the device (positions = N's next_pos +
arange, drafts and q = N's device proposal), so this module does the same draws with tensor ops:

    uniforms_on_device   random.uniforms bit for bit: SplitMix64 in int64 tensor arithmetic
                         (wrapping multiply and add, logical shifts by masking)
    sample_on_device     the Sampler's draw for rows that need only temperature / top-k / top-p /
                         min-p (no grammar): greedy rows argmax, sampled rows
                         inverse CDF at the SAMPLE stream; rows that verify a sampled draft ("sampled"
                         rule) accept with min(1, p/q) or resample the residual (rejection.py)
    penalize_on_device   the Sampler's presence / frequency penalties, the history partly on the device
    logprobs_on_device   the Sampler's logprobs of those rows (raw log_softmax, the sampled token's and
                         the top 20), copied to the host at launch (DeviceLogprobs)

The per-request seed stream key is made on the host (the seed is host-known); only the position
mixing runs on the device. Same filters, same inverse CDF, same rejection code as the Sampler, so
a row's token equals the Sampler's (tests/sample/test_device_sampling.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from deepinfer.host_copy import host_tensor
from deepinfer.sample.random import ACCEPT, RESIDUAL, SAMPLE, _MASK64, purpose_seed, splitmix64
from deepinfer.sampling_params import SamplingParams


def _signed(c: int) -> int:
    """A uint64 constant as the int64 with the same bits."""
    return c - (1 << 64) if c >= 1 << 63 else c


_C0, _C1, _C2 = _signed(0x9E3779B97F4A7C15), _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)


def _srl(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _splitmix64(x: torch.Tensor) -> torch.Tensor:
    x = x + _C0
    x = (x ^ _srl(x, 30)) * _C1
    x = (x ^ _srl(x, 27)) * _C2
    return x ^ _srl(x, 31)


def uniforms_on_device(seeds: list[int], positions: torch.Tensor, purpose: int = SAMPLE) -> torch.Tensor:
    """[N] float64 on positions' device: random.uniforms(seeds, positions, purpose) without reading
    the positions on the host."""
    keys = [_signed(splitmix64(purpose_seed(s, purpose) & _MASK64)) for s in seeds]
    k = host_tensor(keys, torch.int64, positions.device)
    h = _splitmix64(k ^ positions.to(torch.int64))
    return _srl(h, 11).to(torch.float64) * (1.0 / (1 << 53))


def device_samplable(p: SamplingParams | None) -> bool:
    """The request's token (its logprobs: logprobs_on_device; its penalties: penalize_on_device) needs
    nothing but its logits, seed, position and the tokens so far (no grammar, whose state is the host's)."""
    return p is not None and p.constraint is None


def penalized(p: SamplingParams | None) -> bool:
    return p is not None and bool(p.presence_penalty or p.frequency_penalty)


def penalize_on_device(logits: torch.Tensor, rows: list[int], params: list[SamplingParams],
                       known: list[np.ndarray], owner: list[int], new: torch.Tensor, lookahead: torch.Tensor,
                       lookahead_len: list[int]) -> torch.Tensor:
    """The Sampler's presence / frequency penalties (Sampler._apply_penalties) for logits rows `rows` of
    [N, V] logits, whose output tokens so far are partly on the device -> the penalized copy. Row i's
    history: known[owner[i]] (its request's outputs the host has, int64 arrays, counted once a request),
    then new[i] (device, -1 = none: the previous step's new tokens), then lookahead[i, :lookahead_len[i]]
    (device: the drafts the row's step fed before it). Counts are whole numbers: any order of adds is exact."""
    dev = logits.device
    vocab = logits.shape[1]
    per_request = torch.zeros(len(known), vocab, dtype=torch.float32, device=dev)
    sizes = [len(k) for k in known]
    if sum(sizes):
        req = host_tensor(np.repeat(np.arange(len(known)), sizes), torch.int64, dev)
        tok = host_tensor(np.concatenate(known).astype(np.int64), torch.int64, dev)
        per_request.index_put_((req, tok), torch.ones(len(tok), device=dev), accumulate=True)
    counts = per_request[host_tensor(owner, torch.int64, dev)]
    counts.scatter_add_(1, new.clamp(min=0), (new >= 0).float())
    j = torch.arange(lookahead.shape[1], device=dev)
    upto = host_tensor(lookahead_len, torch.int64, dev)
    counts.scatter_add_(1, lookahead.to(torch.int64).clamp(min=0), (j[None, :] < upto[:, None]).float())
    freq = host_tensor([p.frequency_penalty for p in params], torch.float32, dev)
    pres = host_tensor([p.presence_penalty for p in params], torch.float32, dev)
    out = logits.clone()
    at = host_tensor(rows, torch.int64, dev)
    out[at] = logits[at] - (freq[:, None] * counts + pres[:, None] * (counts > 0))
    return out


@dataclass
class DeviceLogprobs:
    """The Sampler's logprobs of a step's rows, computed on the device (raw_logprobs) and copied to the
    host at launch: rows idx asked, top_n alternatives each; rows() once the launch's event fired."""
    num_rows: int
    idx: list[int]
    top_n: list[int]
    sampled: torch.Tensor       # [n] the sampled token's logprob (host copies)
    top_ids: torch.Tensor       # [n, MAX_TOP_LOGPROBS]
    top_vals: torch.Tensor      # [n, MAX_TOP_LOGPROBS]

    def rows(self) -> list:
        from deepinfer.sample.sampler import token_logprobs
        return token_logprobs(self.num_rows, self.idx, self.top_n, self.sampled.tolist(), self.top_ids.tolist(),
                              self.top_vals.tolist())


def logprobs_on_device(logits: torch.Tensor, tokens: torch.Tensor, params: list[SamplingParams | None],
                       to_host) -> DeviceLogprobs | None:
    """logits [N, V] fp32, tokens [N] (device), params [N] per row -> the rows' logprobs as the Sampler
    gives them, with no host read: to_host(tensor) starts a copy (the launch's event covers it); None
    where no row asks."""
    from deepinfer.sample.sampler import raw_logprobs
    idx = [i for i, p in enumerate(params) if p is not None and p.logprobs is not None]
    if not idx:
        return None
    rows = host_tensor(idx, torch.int64, logits.device)
    lp, top = raw_logprobs(logits[rows])
    sampled = lp.gather(1, tokens[rows].to(torch.int64)[:, None])[:, 0]
    return DeviceLogprobs(len(params), idx, [params[i].logprobs for i in idx], to_host(sampled),
                          to_host(top.indices), to_host(top.values))


@dataclass
class DeviceRows:
    """The logits rows of a step, for sample_on_device. Host lists are the step's shape (known at
    build); tensors are on the device."""
    params: list[SamplingParams]        # [N] per logits row
    seeds: list[int]                    # [N] the request's resolved seed (unused for greedy rows)
    positions: torch.Tensor             # [N] int64: absolute position of the token each row samples
    draft_ids: torch.Tensor | None = None     # [N] "sampled" rule: the draft each row verifies
    draft_probs: torch.Tensor | None = None   # [N, V] its q (rows without one: any, masked by verifies)
    verifies: torch.Tensor | None = None      # [N] bool: the row verifies a sampled draft


def sample_on_device(logits: torch.Tensor, rows: DeviceRows) -> torch.Tensor:
    """logits [N, V] fp32 -> [N] int64 tokens on the device, as Sampler.sample's _draw for these rows."""
    from deepinfer.sample.rejection import speculative_rows
    from deepinfer.sample.sampler import filtered_probs, inverse_cdf
    out = logits.argmax(dim=-1)
    rand = [i for i, p in enumerate(rows.params) if not p.greedy]
    if not rand:
        return out
    sel = host_tensor(rand, torch.int64, logits.device)
    seeds = [rows.seeds[i] for i in rand]
    pos = rows.positions[sel]
    on_gpu = logits.device.type == "cuda"
    probs = filtered_probs(logits[sel].float(), [rows.params[i] for i in rand], no_host_read=on_gpu)
    tok = inverse_cdf(probs, uniforms_on_device(seeds, pos, SAMPLE))
    if rows.verifies is not None:
        u_accept, u_residual = uniforms_on_device(seeds, pos, ACCEPT), uniforms_on_device(seeds, pos, RESIDUAL)
        spec = speculative_rows(probs, rows.draft_ids[sel], rows.draft_probs[sel], u_accept, u_residual)
        tok = torch.where(rows.verifies[sel], spec, tok)
    out[sel] = tok
    return out
