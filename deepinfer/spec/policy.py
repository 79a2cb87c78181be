"""Which drafts to verify: the DSpark paper's scheduling rule (MODEL.md section 8.2), no torch.

The confidence head gives c_k = sigmoid(logit_k), an estimate of P(draft k accepted | drafts
1..k-1 accepted). The prefix survival a_j = prod_{i<=j} c_i is the probability that drafts 1..j
are all accepted, i.e. the expected gain of verifying draft j. The static rule verifies the
longest prefix with a_j >= threshold (a_j only decreases, so this is "verify while it pays"):

    c:    0.9   0.8   0.7   0.4   0.9
    a_j:  0.90  0.72  0.50  0.20  0.18      threshold 0.5 -> verify drafts 1..3

threshold 0 verifies every draft; threshold > 1 none. The paper's batch-level admission (sort all
(request, j) by a_j, admit while tau * SPS(batch tokens) improves) is not implemented; the static
threshold is its diagnostic baseline.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def prefix_survival(confidence_logits: list[float]) -> list[float]:
    """[k] confidence logits -> [k] a_j = prod_{i<=j} sigmoid(logit_i)."""
    out, a = [], 1.0
    for c in confidence_logits:
        a *= _sigmoid(c)
        out.append(a)
    return out


@dataclass(frozen=True)
class StaticThresholdPolicy:
    threshold: float = 0.5

    def num_to_verify(self, confidence_logits: list[float]) -> int:
        n = 0
        for a in prefix_survival(confidence_logits):
            if a < self.threshold:
                break
            n += 1
        return n


def _sigmoid(x: float) -> float:
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)
    return e / (1.0 + e)
