"""Speculation that pauses where it loses (EngineArgs.spec_pause, with the confidence scheduler): after
each schedule the scheduler says whether the batch drafts after this step (SchedulerOutput.draft_after).
A step that verifies no draft still pays for the drafting pass that follows it; where that pass and the
verify rows cost more than the accepted drafts gain, plain decode steps are faster. H200, 2026-12-03,
full-width-ep8 (7 layers) at batch 64: a plain step 5.1 ms, a speculative step verifying nothing 10.3.

    this step's best speculative rate   S = (n + expected accepted of the best B) / t(n, B)   (budget.py)
    a plain step's rate                 P = n / t_plain(n)   (profiled: no drafts, no drafting pass)
    draft after this step               iff S >= P; during a pause (no proposals, so no confidences to
                                        tell) every probe_every-th step drafts, and the step verifying
                                        those drafts decides again

Pausing keeps speculation lossless (a plain step samples what verification would have); the DSpark
rings still absorb every accepted row, so drafting resumes on a whole context.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DraftingGate:
    probe_every: int = 16
    _score: tuple[int, float] | None = None     # (n, S) of this step's budget, read by the next draft_after
    _paused: int = 0                             # plain steps since the pause began (0: not paused)

    def __post_init__(self) -> None:
        if self.probe_every < 1:
            raise ValueError(f"probe_every must be >= 1, got {self.probe_every}")

    def record(self, num_seqs: int, score: float) -> None:
        """The best expected tokens per second the budget found for this step's n requests."""
        self._score = (num_seqs, score)

    def draft_after(self, plain_time) -> bool:
        """Whether the step being scheduled drafts after it. plain_time(n): a plain step's seconds at n
        requests, None when not profiled (never pause)."""
        score, self._score = self._score, None
        if score is not None:
            n, s = score
            t = plain_time(n)
            if t is None or s >= n / t:
                self._paused = 0
                return True
            self._paused = 1
            return False
        if not self._paused:            # no budget this step (new requests, nothing proposed): draft
            return True
        self._paused += 1
        return self._paused % self.probe_every == 0

    @property
    def paused(self) -> bool:
        return self._paused > 0
