"""The scheduler's side of a verify step scheduled while the previous one is unresolved (issue 19):
the worst case is reserved, and trimmed when the accepted counts arrive a step later.

A request R whose verify step N (k drafts) is in flight has k + 1 new tokens at most. Step N+1
for R is scheduled as if every draft were accepted (the largest positions, the fewest tokens left
under max_tokens) and runs the anchor plus K' drafts, its positions taken on the device from N's
resolution (spec/device_resolution.py):

    cached after schedule(N):   | ... start_N + q_N = c |             (all k drafts counted in)
    worst case, N+1 runs:       c .. c + K'              -> blocks reserved through c + K'
    N resolves with a < k:      every position shifts down by k - a: c -= k - a, blocks past freed

Rollback stays free: positions past the trimmed end are never read (addressed by position), and
the trim is one KVCacheManager.rollback. Plain integers, no torch; the Scheduler calls these.
"""

from __future__ import annotations

from deepinfer.cache.kv_cache_manager import KVCacheManager
from deepinfer.request import Request


def worst_case_drafts(req: Request, drafts_in_flight: int, num_speculative_tokens: int,
                      max_model_len: int) -> int | None:
    """Drafts R's next verify step reserves for while a step verifying `drafts_in_flight` drafts
    (and sampling one token more) is unresolved; None: with every draft accepted R may already be
    done (max_tokens or the context), so it is not scheduled until the counts arrive."""
    p = req.sampling_params
    most_outputs = req.num_output_tokens + req.num_output_placeholders + drafts_in_flight
    if most_outputs >= p.max_tokens or req.num_computed_tokens >= max_model_len:
        return None
    room = p.max_tokens - most_outputs - 1                 # the next step samples one token more
    return max(0, min(num_speculative_tokens, room, max_model_len - req.num_computed_tokens - 1))


def reserve(kv: KVCacheManager, req: Request, num_drafts: int) -> list[int] | None:
    """Blocks for the anchor and num_drafts drafts past R's worst-case end; None: the pool is short
    (nothing taken: the caller preempts, as for any allocation)."""
    return kv.allocate_slots(req.request_id, req.num_computed_tokens + 1 + num_drafts)


def trim(kv: KVCacheManager, req: Request, num_rejected: int) -> None:
    """Step N's counts arrived: num_rejected = k - a of its drafts were not accepted. Every later
    position of R (step N+1 in flight included) moves down by that much; blocks past the new end go."""
    if num_rejected <= 0:
        return
    req.num_computed_tokens -= num_rejected
    kv.rollback(req.request_id, req.num_computed_tokens)
