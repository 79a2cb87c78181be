"""The scheduler's ledger of DSpark proposals: drafts wait here, with their confidences, until the
next schedule() asks the verification policy how many of each to verify, over the whole batch at
once (spec/policy.py, spec/budget.py). Plain lists, no torch; keyed by request id.

    update_from_output(step N):  book.propose(req, drafts, confidences, room)   (previous ones kept as `older`)
    schedule(step N+1):          book.plan(running ids) -> {req id: drafts to verify}
                                 book.draft_after(n) -> whether step N+1 drafts (spec/pause.py)
    preempt / finish:            book.drop(req id)
"""

from __future__ import annotations

import math

from deepinfer.spec.policy import DraftEntry


class DraftBook:
    def __init__(self, policy) -> None:
        self.policy = policy                                   # .assign(list[DraftEntry]) -> list[int]
        self._pending: dict[str, tuple[list[int], list[float], list[float] | None]] = {}
        self._last_confidences: dict[str, list[float]] = {}   # each request's previous proposal

    def propose(self, req_id: str, drafts: list[int], confidences: list[float] | None, room: int) -> None:
        """drafts of one request (room: how many max_tokens still leaves room for)."""
        n = max(0, min(len(drafts), room))
        confs = list(confidences) if confidences else [math.inf] * len(drafts)   # none: certain
        older = self._last_confidences.get(req_id)
        self._pending[req_id] = (list(drafts[:n]), confs[:n], older)
        if confidences:
            self._observe(older, confs)
        self._last_confidences[req_id] = confs

    def plan(self, req_ids: list[str]) -> dict[str, list[int]]:
        """The drafts each of req_ids (batch order) verifies next; every pending proposal is consumed."""
        ids = [r for r in req_ids if r in self._pending and self._pending[r][0]]
        entries = [DraftEntry(len(self._pending[r][0]), self._pending[r][1], self._pending[r][2]) for r in ids]
        counts = self.policy.assign(entries) if entries else []
        plan = {r: self._pending[r][0][:n] for r, n in zip(ids, counts)}
        self._pending.clear()
        return plan

    def draft_after(self, num_seqs: int) -> bool:
        """Whether the step just planned drafts after it (a policy that can pause speculation decides,
        spec/pause.py; the others always draft)."""
        decide = getattr(self.policy, "draft_after", None)
        return True if decide is None else decide(num_seqs)

    def remember(self, req_id: str, confidences: list[float]) -> None:
        """A proposal an overlapped step verifies without a plan (spec/overlap_verify.py): only its
        confidences are kept, the `older` of the next budget."""
        self._observe(self._last_confidences.get(req_id), confidences)
        self._last_confidences[req_id] = list(confidences)

    def _observe(self, older: list[float] | None, newest: list[float]) -> None:
        """A policy that learns from consecutive proposals (VerifyBudgetPolicy.observe) sees this pair."""
        observe = getattr(self.policy, "observe", None)
        if observe is not None and older and all(math.isfinite(c) for c in older):
            observe(older, newest)

    def last_confidences(self, req_id: str) -> list[float] | None:
        """req_id's latest proposal's confidence logits the host has (None: none yet)."""
        return self._last_confidences.get(req_id)

    def pending(self, req_id: str) -> list[int]:
        """The drafts of req_id waiting for the next plan ([] if none)."""
        return list(self._pending[req_id][0]) if req_id in self._pending else []

    def drop(self, req_id: str) -> None:
        self._pending.pop(req_id, None)
        self._last_confidences.pop(req_id, None)
