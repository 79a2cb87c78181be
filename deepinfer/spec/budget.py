"""The confidence-scheduled verification budget (DSpark paper Algorithm 1; DeepInfer
csrc/engine/mtp_varlen.hpp:150-267, read for semantics): per step, the number B of draft tokens
the whole batch verifies is the one that maximizes expected accepted tokens per second of step
time, and B is split over the requests by their newest confidences.

n requests, each with survival a_(r,j) = prod_{i<=j} c_(r,i) of its drafts j = 1..k_r:

    budget list   all (a_(r,j)) from the budget confidences, sorted descending
    B = 0:        expected = n (each request samples one token for sure), score = n / t(n, 0)
    B -> B + 1:   expected += next a, score = expected / t(n, B); keep the argmax over B
                  (early_stop: stop at the first B that does not improve, the paper's variant)
    split         the B largest a_(r,j) of the newest confidences; request r verifies as many
                  drafts as it has among them (a prefix: a_(r,j) only decreases in j)

t(n, B) is the profiled step time (spec/step_time.py) of n requests verifying B drafts in all.
budget_confidences="older" takes the budget from the previous proposal's confidences (two steps
old: what DeepInfer's asynchronous production scheduler has when it picks B) and "newest" from
the current ones; a request without older confidences counts each draft as 1.0 (DeepInfer's
padding for requests that have drafts). With `calibration` (spec/older_calibration.py, the engine's
default) the older survivals are replaced by the newest ones they predict, as measured online, and a
request without older confidences gets the mean survival.

Acceptance floor (`acceptance_floor` f, off by default): B is at least the smallest budget whose expected
accepted tokens n + sum of the B largest reach f x (n + sum of all): a deployment that sells per-user speed
keeps ~all of verify-all's accepted length while the least likely drafts are still cut (at 40 layers the
argmax alone cut 59% of the drafts at 0.92 of the accepted length, H200, 2026-12-03). With padded steps the
same floor bounds the cap L from below.

Padded steps (`padded`): DeepInfer's varlen kernels make a step cost what it verifies in all; our
verify steps through CUDA graphs run every request padded to the longest one's length (the graph
of (batch, L)), so a step costs t(n, n * L) however the drafts are split, and a request verifying
fewer than L drafts saves nothing. There the budget is a cap: the L in 0 .. k maximizing
(n + sum over requests of their first min(L, k_r) survivals) / t(n, n * L), every request verifying
min(L, k_r) (H200, 2026-12-02: the ragged split cut 31% of the drafts at batch 64 and ran slower
than verify-all, 0.66x against 0.71x of no speculation, since its steps still ran at the longest
length).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from deepinfer.spec.older_calibration import OlderCalibration
from deepinfer.spec.pause import DraftingGate
from deepinfer.spec.policy import DraftEntry, prefix_survival
from deepinfer.spec.step_time import StepTimeModel

BUDGET_CONFIDENCES = ("older", "newest")


@dataclass(frozen=True)
class VerifyBudgetPolicy:
    step_time: StepTimeModel
    early_stop: bool = False
    budget_confidences: str = "older"
    # padded(n, length): a verify step of n requests up to `length` tokens each runs padded to it (a
    # CUDA graph); None: steps cost what they verify (eager, varlen)
    padded: Callable[[int, int], bool] | None = None
    # the older confidences calibrated online against the newest (None: taken as they are)
    calibration: OlderCalibration | None = None
    # pause speculation where a plain step is faster (spec/pause.py; needs step_time.plain_seconds)
    pause: DraftingGate | None = None
    # the budget keeps at least this fraction of verify-all's expected accepted tokens (None: argmax only)
    acceptance_floor: float | None = None

    def __post_init__(self) -> None:
        if self.budget_confidences not in BUDGET_CONFIDENCES:
            raise ValueError(f"spec_budget_confidences must be one of {BUDGET_CONFIDENCES}, "
                             f"got {self.budget_confidences!r}")
        f = self.acceptance_floor
        if f is not None and not 0.0 < f <= 1.0:
            raise ValueError(f"spec_acceptance_floor must be in (0, 1] or None, got {f}")

    def assign(self, entries: list[DraftEntry]) -> list[int]:
        if not entries:
            return []
        survivals = [self._budget_survival(e) for e in entries]
        cap = self.best_cap([e.num_drafts for e in entries], survivals)
        if cap is not None:
            return [min(e.num_drafts, cap) for e in entries]
        budget = self.best_budget(len(entries), sorted((a for s in survivals for a in s), reverse=True))
        return split_budget(entries, budget)

    def best_cap(self, num_drafts: list[int], survival: list[list[float]]) -> int | None:
        """Padded steps: the cap L maximizing expected tokens / t(n, n * L) (module docstring); None
        when this batch's verify steps do not run padded (the budget split applies)."""
        n, k = len(num_drafts), max(num_drafts, default=0)
        if self.padded is None or k == 0 or not self.padded(n, 2):
            return None
        gains = [sum(a[cap - 1] for a, kr in zip(survival, num_drafts) if kr >= cap) for cap in range(1, k + 1)]
        expected = float(n)
        best_l, best = 0, expected / self.step_time.time(n, 0)
        for cap, gain in enumerate(gains, start=1):
            expected += gain
            score = expected / self.step_time.time(n, n * cap)
            if score > best:
                best_l, best = cap, score
            elif self.early_stop:
                break
        if self.pause is not None:
            self.pause.record(n, best)
        return max(best_l, self.floor_count(n, gains))

    def best_budget(self, num_seqs: int, survival_desc: list[float]) -> int:
        """B in [0, len(survival_desc)] maximizing (num_seqs + sum of the B largest) / t(num_seqs, B)."""
        times = self.step_time.times(num_seqs, len(survival_desc))
        expected = float(num_seqs)
        best_b, best = 0, expected / times[0]
        for b, a in enumerate(survival_desc, start=1):
            expected += a
            score = expected / times[b]
            if score > best:
                best_b, best = b, score
            elif self.early_stop:
                break
        if self.pause is not None:
            self.pause.record(num_seqs, best)
        return max(best_b, self.floor_count(num_seqs, survival_desc))

    def floor_count(self, base: float, gains: list[float]) -> int:
        """The fewest leading `gains` (expected accepted drafts, best first) with base + their sum >=
        acceptance_floor x (base + all of them); 0 without a floor."""
        if self.acceptance_floor is None:
            return 0
        target = self.acceptance_floor * (base + sum(gains)) * (1 - 1e-12)   # the full sum's rounding
        expected = float(base)
        for i, g in enumerate(gains):
            if expected >= target:
                return i
            expected += g
        return len(gains)

    def draft_after(self, num_seqs: int) -> bool:
        """Whether the step just planned drafts after it (spec/pause.py; without a gate: always)."""
        return True if self.pause is None else self.pause.draft_after(self.step_time.plain_time)

    def with_older_confidences(self) -> "VerifyBudgetPolicy":
        """This policy taking its budget from the older confidences (an overlapped step's host half)."""
        return self if self.budget_confidences == "older" else replace(self, budget_confidences="older")

    def observe(self, older: list[float], newest: list[float]) -> None:
        """A request's previous and new proposal's confidence logits (DraftBook): calibration data."""
        if self.calibration is not None and older and newest:
            self.calibration.observe(prefix_survival(older), prefix_survival(newest))

    def _budget_survival(self, e: DraftEntry) -> list[float]:
        if self.budget_confidences == "newest":
            return prefix_survival(e.newest[:e.num_drafts])
        cal = self.calibration
        if not e.older:
            mean = cal.mean(e.num_drafts) if cal is not None else None
            return mean if mean is not None else [1.0] * e.num_drafts
        a = prefix_survival(e.older[:e.num_drafts])
        a = a + [a[-1]] * (e.num_drafts - len(a))     # an older proposal that was shorter
        return cal.predict(a) if cal is not None else a


def split_budget(entries: list[DraftEntry], budget: int) -> list[int]:
    """The `budget` largest newest survivals; ties go to the earlier request (DeepInfer's order)."""
    return split_by_survival([prefix_survival(e.newest[:e.num_drafts]) for e in entries], budget)


def split_by_survival(survivals: list[list[float]], budget: int) -> list[int]:
    """Drafts per request: the `budget` largest of the survivals [request][draft] (a prefix of each,
    survivals fall with the draft index); ties go to the earlier request."""
    ranked = sorted(((a, r) for r, s in enumerate(survivals) for a in s), key=lambda t: (-t[0], t[1]))
    counts = [0] * len(survivals)
    for _, r in ranked[:budget]:
        counts[r] += 1
    return counts
