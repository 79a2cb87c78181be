"""The verification policy inside overlapped verify steps (issue 19; spec/overlap.py): the step
N+1 launched before step N resolves verifies drafts of the proposal N made on the device, whose
confidences the host does not have yet. The policy is split as in DeepInfer's asynchronous
production scheduler (mtp_varlen): what needs only what the host knows is decided on the host,
what needs the newest confidences is computed where they are, on the device.

    host   (schedule_overlapped)   plan_overlapped: K'_i (the worst case) per request, and
                                   VerifyBudgetPolicy: B = best_budget over the OLDER confidences
                                   (the previous proposal's, two steps old: the newest the host has);
                                   FixedDraftsPolicy: K'_i capped at n on the host
    device (the overlapped build)  verified_counts: k_i <= K'_i from the NEWEST confidences:
                                   budget    the top-B prod-cumulative survivals (split_budget's
                                             ranking: descending, ties to the earlier request)
                                   threshold the prefix with newest survival >= t (it reads only
                                             the newest confidences, so it runs here whole)

k_i feeds the build (q_i = 1 + k_i on the device; the static graph keeps its padded L, rows past
q_i are padding) and the device-side resolution; the host learns k_i with the step's resolution
(ModelRunnerOutput.num_verified) for its counters. The worst-case reservation (K'_i) and its trim
(K'_i - a_i positions: the positions run are start .. start + a_i either way) are unchanged.

Survivals are computed in float64 with the formula of policy._sigmoid, so the device's ranking
and threshold comparisons are the host's (tested equal on random ragged inputs with ties).
budget_confidences="newest" has no meaning here (the host never has the newest before launch):
overlapped steps take B from the older confidences, as DeepInfer does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.spec.budget import VerifyBudgetPolicy
from deepinfer.spec.policy import DraftEntry, FixedDraftsPolicy, StaticThresholdPolicy


@dataclass(frozen=True)
class OverlapVerify:
    """What an overlapped step's device applies to its K'_i (SchedulerOutput.overlap_verify)."""
    budget: int | None = None        # the batch verifies B drafts, split by the newest survivals
    threshold: float | None = None   # each request verifies its prefix with newest survival >= t


def plan_overlapped(policy, num_drafts: list[int], older: list[list[float] | None]) -> tuple[list[int], OverlapVerify | None]:
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
        older_policy = policy if policy.budget_confidences == "older" else VerifyBudgetPolicy(
            policy.step_time, policy.early_stop, "older")
        survival = sorted((a for e in entries for a in older_policy._budget_survival(e)), reverse=True)
        return list(num_drafts), OverlapVerify(budget=policy.best_budget(len(entries), survival))
    return list(num_drafts), None          # VerifyAllPolicy, or a policy without a device form


def prefix_survival_on_device(confidence_logits: torch.Tensor) -> torch.Tensor:
    """[n, K] logits -> [n, K] float64 a_(i,j) = prod_{l<=j} sigmoid(c_(i,l)), as policy.prefix_survival."""
    x = confidence_logits.to(torch.float64)
    pos = 1.0 / (1.0 + torch.exp(-x.clamp_min(0)))
    e = torch.exp(x.clamp_max(0))
    s = torch.where(x >= 0, pos, e / (1.0 + e))
    return torch.cumprod(s, dim=1)


def split_budget_on_device(confidence_logits: torch.Tensor, num_drafts: torch.Tensor, budget: int) -> torch.Tensor:
    """spec/budget.split_budget on the device: [n] int64 counts of each request's drafts among the
    `budget` largest survivals of its first num_drafts[i]; ties go to the earlier request."""
    n, K = confidence_logits.shape
    dev = confidence_logits.device
    if n == 0 or K == 0:
        return torch.zeros(n, dtype=torch.int64, device=dev)
    a = prefix_survival_on_device(confidence_logits)
    j = torch.arange(K, device=dev)
    valid = j[None, :] < num_drafts.to(dev)[:, None]
    key = torch.where(valid, a, torch.full_like(a, -1.0)).reshape(-1)    # survivals are >= 0
    order = torch.sort(key, descending=True, stable=True).indices        # equal keys: row-major order
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=dev)
    chosen = (rank < budget).reshape(n, K) & valid
    return chosen.sum(dim=1)


def threshold_counts_on_device(confidence_logits: torch.Tensor, num_drafts: torch.Tensor, threshold: float) -> torch.Tensor:
    """StaticThresholdPolicy on the device: [n] the longest prefix with survival >= threshold, capped."""
    a = prefix_survival_on_device(confidence_logits)
    n = torch.cumprod((a >= threshold).to(torch.int64), dim=1).sum(dim=1)
    return torch.minimum(n, num_drafts.to(n.device))


def verified_counts(plan: OverlapVerify | None, confidence_logits: torch.Tensor, num_drafts: torch.Tensor) -> torch.Tensor:
    """[n] int64 drafts each request of the overlapped step verifies (<= num_drafts), on the device."""
    num_drafts = num_drafts.to(confidence_logits.device)
    K = confidence_logits.shape[1]
    if plan is not None and plan.budget is not None:
        return split_budget_on_device(confidence_logits, num_drafts.clamp_max(K), plan.budget)
    if plan is not None and plan.threshold is not None:
        return threshold_counts_on_device(confidence_logits, num_drafts, plan.threshold)
    return num_drafts.clone()
