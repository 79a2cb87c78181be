"""The verification policy inside overlapped verify steps, the host half (issue 19; spec/overlap.py):
the step N+1 launched before step N resolves verifies drafts of the proposal N made on the device, whose
confidences the host does not have yet. The policy is split as in DeepInfer's asynchronous
production scheduler (mtp_varlen): what needs only what the host knows is decided on the host,
what needs the newest confidences is computed where they are, on the device.

    host   (schedule_overlapped)   plan_overlapped: K'_i (the worst case) per request, and
                                   VerifyBudgetPolicy on padded steps (CUDA graphs, budget.py): the
                                   cap L from the OLDER confidences, K'_i capped at L on the host;
                                   else B = best_budget over the OLDER confidences
                                   (the previous proposal's, two steps old: the newest the host has,
                                   calibrated: older_calibration.py) and K'_i capped by B's split
                                   over the requests by them (packed steps cost the rows laid out,
                                   so the device verifies all of them: no device budget);
                                   FixedDraftsPolicy: K'_i capped at n on the host
    device (the overlapped build)  device_verify.verified_counts: k_i <= K'_i from the NEWEST confidences:
                                   budget    the top-B prod-cumulative survivals (split_budget's
                                             ranking: descending, ties to the earlier request)
                                   threshold the prefix with newest survival >= t (it reads only
                                             the newest confidences, so it runs here whole)

The device half is spec/device_verify.py (tensors; this module stays plain: the scheduler imports it).
k_i feeds the build (q_i = 1 + k_i on the device; the static layout keeps 1 + K'_i rows per
request, rows past q_i are padding) and the device-side resolution; the host learns k_i with the step's resolution
(ModelRunnerOutput.num_verified) for its counters. The worst-case reservation (K'_i) and its trim
(K'_i - a_i positions: the positions run are start .. start + a_i either way) are unchanged.

budget_confidences="newest" has no meaning here (the host never has the newest before launch):
overlapped steps take B from the older confidences, as DeepInfer does.
"""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer.spec.budget import VerifyBudgetPolicy, split_by_survival
from deepinfer.spec.policy import DraftEntry, FixedDraftsPolicy, StaticThresholdPolicy


@dataclass(frozen=True)
class OverlapVerify:
    """What an overlapped step's device applies to its K'_i (SchedulerOutput.overlap_verify)."""
    budget: int | None = None        # the batch verifies B drafts, split by the newest survivals
    threshold: float | None = None   # each request verifies its prefix with newest survival >= t


def plan_overlapped(policy, num_drafts: list[int],
                    older: list[list[float] | None]) -> tuple[list[int], OverlapVerify | None]:
    """(K'_i capped where the host can cap them, what the device applies; None: verify all K'_i).
    num_drafts [n]: each request's worst-case drafts; older [n]: its last proposal's confidence
    logits the host has (None: none)."""
    if isinstance(policy, FixedDraftsPolicy):
        return [min(k, policy.n) for k in num_drafts], None
    if isinstance(policy, StaticThresholdPolicy):
        return list(num_drafts), OverlapVerify(threshold=policy.threshold)
    if isinstance(policy, VerifyBudgetPolicy):
        entries = [DraftEntry(k, [], o) for k, o in zip(num_drafts, older) if k > 0]
        if not entries:
            return list(num_drafts), None
        older_policy = policy.with_older_confidences()
        survivals = [older_policy._budget_survival(e) for e in entries]
        cap = older_policy.best_cap([e.num_drafts for e in entries], survivals)
        if cap is not None:     # padded steps: a cap on the host shortens the step itself (budget.py)
            return [min(k, cap) for k in num_drafts], None
        survival = sorted((a for s in survivals for a in s), reverse=True)
        budget = policy.best_budget(len(entries), survival)
        # packed (varlen) steps cost the rows laid out on the host: K'_i from the host's split of B (by
        # the calibrated older survivals), and the device verifies every draft laid out. Trimming within
        # K'_i by the newest confidences would save nothing (the rows are computed either way) and only
        # drop drafts that might have been accepted: on the H200 (2026-12-03, regimes of 32 positions,
        # kappa 0.5, batch 64) that trim cut verified drafts 57% at 0.91 of verify-all's accepted length
        # while the steps cost what verify-all's did
        split = iter(split_by_survival(survivals, budget))
        return [min(k, next(split)) if k > 0 else k for k in num_drafts], None
    return list(num_drafts), None          # VerifyAllPolicy, or a policy without a device form
