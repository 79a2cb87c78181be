"""The step-time model of the verification scheduler: engine step time by batch size and verified
drafts, profiled at engine start through the engine's own step (schedule, the real forward,
sampling, acceptance, the DSpark proposal), on whatever device it runs (DeepInfer profiles its
decode graphs the same way: model_runner.py profile_decode_perf, 1 warm-up + timed runs).

    grid:   batch sizes n_1 < n_2 < ...  x  drafts per request x_1 < x_2 < ... (0 .. k)
    t(n, B) = bilinear interpolation at (n, B / n) of the median step seconds; clamped to the grid

A step cannot get cheaper by verifying more, so each batch size's row of medians is made
non-decreasing in x by pooling adjacent violators (the least-squares monotone fit): on the H200
(2026-12-03, async scheduling) single points came out 50% above their neighbours (n = 2: 6.4, 9.7,
9.2, 9.3, 9.8, 6.6 ms), which made the scheduler's budget follow the noise.

Profiling: n greedy requests with short prompts are prefilled, then every step verifies exactly x
drafts per request (FixedDraftsPolicy), 1 warm-up + `repeats` timed steps per point; the requests
are aborted at the end and the engine's counters reset. A CPU grid is small (batch sizes 1, 4 and max_num_seqs,
x in {0, k}: a few seconds on the tiny preset); on CUDA every power of two up to max_num_seqs and
every x. Sizes that the token budget or the cache cannot hold are left out.
"""

from __future__ import annotations

import bisect
import logging
import statistics
import time
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

PROFILE_PROMPT_LEN = 16


@dataclass(frozen=True)
class StepTimeModel:
    """Frozen fields; `seconds` is corrected in place by observe() (the online correction), which
    every policy holding this model then sees."""
    batch_sizes: list[int]            # profiled n, ascending
    drafts_per_seq: list[int]         # profiled x, ascending
    seconds: list[list[float]]        # [len(batch_sizes)][len(drafts_per_seq)] median step seconds
    # [len(batch_sizes)] plain steps (no drafts, no drafting pass; spec/pause.py), None: not profiled
    plain_seconds: list[float] | None = None
    # times() per (num_seqs, max_drafts): the budget reads a whole row every step (host time on the
    # critical path of an overlapped step)
    _rows: dict = field(default_factory=dict, compare=False, repr=False)

    def times(self, num_seqs: int, max_drafts: int) -> list[float]:
        """[time(num_seqs, B) for B in 0 .. max_drafts], computed once per (num_seqs, max_drafts)."""
        key = (num_seqs, max_drafts)
        row = self._rows.get(key)
        if row is None:
            row = self._rows[key] = [self.time(num_seqs, b) for b in range(max_drafts + 1)]
        return row

    def time(self, num_seqs: int, num_drafts: int) -> float:
        """Seconds of a step of num_seqs requests verifying num_drafts drafts in all."""
        x = num_drafts / max(num_seqs, 1)
        i, wi = _bracket(self.batch_sizes, num_seqs)
        row = lambda r: _interp(self.drafts_per_seq, self.seconds[r], x)   # noqa: E731
        return row(i) if wi == 0.0 else (1 - wi) * row(i) + wi * row(i + 1)

    def observe(self, num_seqs: int, num_drafts: int, seconds: float, alpha: float, max_ratio: float = 2.0) -> None:
        """Move the model toward one measured step (spec/step_time_online.py): the grid points that
        interpolate (num_seqs, num_drafts) take alpha x their interpolation weight of the error, the
        measurement first clamped to [1 / max_ratio, max_ratio] x the prediction (a stall or a hiccup
        is one step, not a new cost); each row touched stays non-decreasing in drafts."""
        pred = self.time(num_seqs, num_drafts)
        err = min(max(seconds, pred / max_ratio), pred * max_ratio) - pred
        i, wi = _bracket(self.batch_sizes, num_seqs)
        j, wj = _bracket(self.drafts_per_seq, num_drafts / max(num_seqs, 1))
        rows = {}
        for r, w_r in ((i, 1 - wi), (i + 1, wi)):
            for c, w_c in ((j, 1 - wj), (j + 1, wj)):
                if w_r * w_c > 0:
                    self.seconds[r][c] += alpha * w_r * w_c * err
                    rows[r] = True
        for r in rows:
            self.seconds[r][:] = non_decreasing(self.seconds[r])
        self._rows.clear()

    def plain_time(self, num_seqs: int) -> float | None:
        """Seconds of a plain step of num_seqs requests (interpolated over the batch sizes), or None."""
        return None if self.plain_seconds is None else _interp(self.batch_sizes, self.plain_seconds, num_seqs)

    @classmethod
    def flat(cls, seconds: float = 1.0) -> "StepTimeModel":
        """Step time independent of the drafts (the scheduler then verifies every draft)."""
        return cls([1], [0], [[seconds]])


def _bracket(xs: list[int], v: float) -> tuple[int, float]:
    """(i, w): v lies between xs[i] and xs[i+1] at fraction w (clamped to the ends: w = 0)."""
    if v <= xs[0] or len(xs) == 1:
        return 0, 0.0
    if v >= xs[-1]:
        return len(xs) - 1, 0.0
    i = bisect.bisect_right(xs, v) - 1
    return i, (v - xs[i]) / (xs[i + 1] - xs[i])


def _interp(xs: list[int], ys: list[float], v: float) -> float:
    i, w = _bracket(xs, v)
    return ys[i] if w == 0.0 else (1 - w) * ys[i] + w * ys[i + 1]


def profile_grid(device: str, max_num_seqs: int, num_drafts: int) -> tuple[list[int], list[int]]:
    if device.startswith("cuda"):
        sizes = sorted({1 << i for i in range(max_num_seqs.bit_length()) if 1 << i <= max_num_seqs} | {max_num_seqs})
        return sizes, list(range(num_drafts + 1))
    return sorted({1, min(max_num_seqs, 4), max_num_seqs}), sorted({0, num_drafts})


def profile_step_times(engine, repeats: int | None = None, plain: bool = False) -> StepTimeModel | None:
    """Measure the grid through engine.step(); None when no size fits (the caller verifies all).
    plain: also each batch size's plain step (no drafts, no drafting pass: spec/pause.py)."""
    a = engine.args
    cuda = engine.device.startswith("cuda")
    repeats = repeats or (5 if cuda else 2)
    sizes, xs = profile_grid(engine.device, a.max_num_seqs, a.num_speculative_tokens)
    # each point has fresh requests: a prefill step, then repeats + 1 steps of up to k + 1 tokens each
    # (all accepted, in the replay mode); max_tokens caps a request's positions, drafts included
    max_tokens = (repeats + 3) * (a.num_speculative_tokens + 1)
    per_seq = PROFILE_PROMPT_LEN + max_tokens + a.num_speculative_tokens + 1
    blocks = -(-per_seq // a.block_tokens) + 1
    total_blocks = engine.num_cache_blocks * a.data_parallel_size
    sizes = [n for n in sizes if n * blocks <= total_blocks and n * (1 + xs[-1]) <= a.max_num_batched_tokens]
    if not sizes:
        logger.warning("step-time profile: no batch size fits the cache / token budget; verifying all drafts")
        return None
    t0 = time.perf_counter()
    seconds = [[_time_point(engine, n, x, repeats, max_tokens) for x in xs] for n in sizes]
    plain_row = [_time_point(engine, n, 0, repeats, max_tokens, draft=False) for n in sizes] if plain else None
    logger.info("profiled DSpark verify step times for batch sizes %s x drafts %s%s in %.1f s",
                sizes, xs, " and plain steps" if plain else "", time.perf_counter() - t0)
    return StepTimeModel(sizes, xs, [non_decreasing(row) for row in seconds], plain_row)


def non_decreasing(ys: list[float]) -> list[float]:
    """The least-squares non-decreasing fit of ys (pool adjacent violators, equal weights)."""
    blocks: list[list[float]] = []        # [sum, count] per pooled block
    for y in ys:
        blocks.append([y, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, c = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += c
    return [s / c for s, c in blocks for _ in range(int(c))]


def _time_point(engine, n: int, x: int, repeats: int, max_tokens: int, draft: bool = True) -> float:
    from deepinfer.request import RequestStatus
    from deepinfer.sampling_params import SamplingParams
    from deepinfer.spec.policy import FixedDraftsPolicy

    books = _draft_books(engine)
    saved = [b.policy for b in books]
    for b in books:
        b.policy = FixedDraftsPolicy(x, draft=draft)
    ids = [f"__step_time_profile_{n}_{x}_{i}" for i in range(n)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    try:
        for i, req_id in enumerate(ids):
            engine.add_request(req_id, [3 + (7 * i + j) % 97 for j in range(PROFILE_PROMPT_LEN)], params)
        while any(engine.scheduler.requests[r].num_output_tokens == 0 for r in ids):
            engine.step()                                  # prefill; the first drafts are proposed
        times = []
        for _ in range(repeats + 1):                       # the first is the warm-up
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:])
    finally:
        live = [r for r in ids if r in engine.scheduler.requests]
        engine.scheduler.finish_requests(live, RequestStatus.FINISHED_ABORTED)
        for b, p in zip(books, saved):
            b.policy = p


def _draft_books(engine) -> list:
    s = engine.scheduler
    return [sub.draft_book for sub in getattr(s, "schedulers", [s])]
