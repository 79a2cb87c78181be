"""Which drafts to verify: the verification policies (MODEL.md section 8.2, DEEPINFER.md section 3),
plain floats, no torch. The scheduler hands each policy the batch's pending proposals (DraftEntry)
and gets back how many drafts of each to verify.

The confidence head gives c_k = sigmoid(logit_k), an estimate of P(draft k accepted | drafts
1..k-1 accepted). The prefix survival a_j = prod_{i<=j} c_i is the probability that drafts 1..j
are all accepted, i.e. the expected gain of verifying draft j. The static rule verifies the
longest prefix with a_j >= threshold (a_j only decreases, so this is "verify while it pays"):

    c:    0.9   0.8   0.7   0.4   0.9
    a_j:  0.90  0.72  0.50  0.20  0.18      threshold 0.5 -> verify drafts 1..3

threshold 0 verifies every draft; threshold 1 only drafts of certain survival. The batch-wide
scheduler (spec/budget.py) is the paper's hardware-aware rule; the static threshold is its
diagnostic baseline and verify-all DeepInfer's default.
"""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer.spec.portable_exp import exp_nonpositive


@dataclass(frozen=True)
class DraftEntry:
    """One request's pending proposal, as a policy sees it."""
    num_drafts: int                       # drafts it may verify (proposed, capped by max_tokens room)
    newest: list[float]                   # their confidence logits (this proposal)
    older: list[float] | None = None      # the previous proposal's confidence logits (two steps old), if any


def prefix_survival(confidence_logits: list[float]) -> list[float]:
    """[k] confidence logits -> [k] a_j = prod_{i<=j} sigmoid(logit_i)."""
    out, a = [], 1.0
    for c in confidence_logits:
        a *= _sigmoid(c)
        out.append(a)
    return out


@dataclass(frozen=True)
class VerifyAllPolicy:
    """Every proposed draft (DeepInfer's default, DEEPINFER_ENABLE_MTP_VARLEN=0)."""

    def assign(self, entries: list[DraftEntry]) -> list[int]:
        return [e.num_drafts for e in entries]


@dataclass(frozen=True)
class StaticThresholdPolicy:
    threshold: float = 0.5

    def __post_init__(self) -> None:
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"spec_confidence_threshold must be in [0, 1], got {self.threshold}")

    def num_to_verify(self, confidence_logits: list[float]) -> int:
        n = 0
        for a in prefix_survival(confidence_logits):
            if a < self.threshold:
                break
            n += 1
        return n

    def assign(self, entries: list[DraftEntry]) -> list[int]:
        return [min(e.num_drafts, self.num_to_verify(e.newest)) for e in entries]


@dataclass(frozen=True)
class FixedDraftsPolicy:
    """Exactly n drafts each (or all it has): the step-time profile's fixed verify lengths. draft=False:
    no drafting after any step either (the profile's plain steps, spec/pause.py)."""
    n: int
    draft: bool = True

    def assign(self, entries: list[DraftEntry]) -> list[int]:
        return [min(e.num_drafts, self.n) for e in entries]

    def draft_after(self, num_seqs: int) -> bool:
        return self.draft


def _sigmoid(x: float) -> float:
    """With portable_exp's exp (not libm's), so device_verify's tensor form gives the same bits."""
    e = exp_nonpositive(-abs(x))
    return 1.0 / (1.0 + e) if x >= 0 else e / (1.0 + e)
