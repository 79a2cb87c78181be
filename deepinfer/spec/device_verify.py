"""The verification policy inside overlapped verify steps, the device half (spec/overlap_verify.py
has the host half and the layout): from the newest confidences, which only the device has when
the overlapped step is built, the drafts k_i <= K'_i each request verifies, by tensor ops only (no
host read: the build must not wait for the step in flight).

Survivals are computed in float64 with the formula of policy._sigmoid and spec/portable_exp.py's exp (a
library exp differs between devices in the last bit), so the ranking and the threshold comparisons are
the host's bit for bit (tests/spec/test_overlap_verify.py).
"""

from __future__ import annotations

import torch

from deepinfer.spec.overlap_verify import OverlapVerify
from deepinfer.spec.portable_exp import exp_nonpositive_tensor


def prefix_survival_on_device(confidence_logits: torch.Tensor) -> torch.Tensor:
    """[n, K] logits -> [n, K] float64 a_(i,j) = prod_{l<=j} sigmoid(c_(i,l)), as policy.prefix_survival."""
    x = confidence_logits.to(torch.float64)
    e = exp_nonpositive_tensor(-x.abs())
    s = torch.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
    # the host's running product, one column at a time (a device cumprod may scan in another order)
    a = s.clone()
    for j in range(1, a.shape[1]):
        a[:, j] = a[:, j - 1] * s[:, j]
    return a


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


def threshold_counts_on_device(confidence_logits: torch.Tensor, num_drafts: torch.Tensor,
                               threshold: float) -> torch.Tensor:
    """StaticThresholdPolicy on the device: [n] the longest prefix with survival >= threshold, capped."""
    a = prefix_survival_on_device(confidence_logits)
    n = torch.cumprod((a >= threshold).to(torch.int64), dim=1).sum(dim=1)
    return torch.minimum(n, num_drafts.to(n.device))


def verified_counts(plan: OverlapVerify | None, confidence_logits: torch.Tensor,
                    num_drafts: torch.Tensor) -> torch.Tensor:
    """[n] int64 drafts each request of the overlapped step verifies (<= num_drafts), on the device."""
    num_drafts = num_drafts.to(confidence_logits.device)
    K = confidence_logits.shape[1]
    if plan is not None and plan.budget is not None:
        return split_budget_on_device(confidence_logits, num_drafts.clamp_max(K), plan.budget)
    if plan is not None and plan.threshold is not None:
        return threshold_counts_on_device(confidence_logits, num_drafts, plan.threshold)
    return num_drafts.clone()
