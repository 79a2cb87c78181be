"""How much a request's previous proposal says about its current one: the budget's "older"
confidences, calibrated online (spec/budget.py, budget_confidences="older").

The budget B (and, on padded steps, the cap L) is picked before the newest confidences reach the
host, from each request's previous proposal (two steps old), as DeepInfer's asynchronous scheduler
does. Taken at face value that assumes the two proposals are alike. Where they are not (a request's
difficulty changes from step to step), a request whose last proposal was hopeless is budgeted as
hopeless again, and at batch 1 the whole step follows one old draw (H200, 2026-12-03, replayed
confidences drawn independently per proposal with kappa 0.5: the scheduler verified 39% fewer drafts
at 0.73 of verify-all's accepted length).

So the engine measures the relation as it runs: for each draft index j, every time a request makes a
new proposal while its previous one is known, the pair (older survival x_j, newest survival y_j)
updates exponentially weighted sums, and the budget uses the least-squares prediction

    E[y_j | x_j] = mean(y_j) + beta_j (x_j - mean(x_j)),   beta_j = cov(x_j, y_j) / var(x_j) in [0, 1]

(alike proposals: beta = 1, the older survival itself; unrelated: beta = 0, the batch's mean
survival). Predictions are clipped to [0, 1] and kept non-increasing in j (a survival is a
prefix product). Until MIN_PAIRS pairs are seen the older survivals are used as they are, and a
request without a previous proposal is budgeted at the mean survival (before that: 1.0 per draft,
DeepInfer's padding). Off with EngineArgs(spec_calibrate_older=False).
"""

from __future__ import annotations

MIN_PAIRS = 64
DECAY = 0.998          # weight of the past per pair: about the last 500 pairs count


class OlderCalibration:
    def __init__(self, num_drafts: int, min_pairs: int = MIN_PAIRS, decay: float = DECAY) -> None:
        self.min_pairs, self.decay = min_pairs, decay
        # per draft index: [weight, sum x, sum y, sum xx, sum xy]
        self._sums = [[0.0] * 5 for _ in range(num_drafts)]
        self.num_pairs = 0
        self._fits: list[tuple[float, float, float] | None] | None = None   # per j (mean x, mean y, beta)

    def observe(self, older: list[float], newest: list[float]) -> None:
        """One request's previous and current prefix survivals (as many indices as both have)."""
        d = self.decay
        for s, x, y in zip(self._sums, older, newest):
            s[0] = s[0] * d + 1.0
            s[1] = s[1] * d + x
            s[2] = s[2] * d + y
            s[3] = s[3] * d + x * x
            s[4] = s[4] * d + x * y
        self.num_pairs += 1
        self._fits = None

    @property
    def ready(self) -> bool:
        return self.num_pairs >= self.min_pairs

    def predict(self, older: list[float]) -> list[float]:
        """The expected newest survivals given the older ones (unchanged until ready)."""
        if not self.ready:
            return list(older)
        out, prev = [], 1.0
        for j, x in enumerate(older):
            y = self._fit(j, x) if j < len(self._sums) else prev
            prev = min(prev, max(0.0, min(1.0, y)))
            out.append(prev)
        return out

    def mean(self, num_drafts: int) -> list[float] | None:
        """The mean newest survivals (a request with no previous proposal); None until ready."""
        if not self.ready:
            return None
        out, prev = [], 1.0
        for j in range(num_drafts):
            w, _, sy = self._sums[min(j, len(self._sums) - 1)][:3]
            prev = min(prev, sy / w if w > 0 else prev)
            out.append(prev)
        return out

    def slope(self, j: int) -> float:
        """beta_j (0 with no spread in the older survivals)."""
        w, sx, sy, sxx, sxy = self._sums[j]
        if w <= 0:
            return 1.0
        var = sxx / w - (sx / w) ** 2
        cov = sxy / w - (sx / w) * (sy / w)
        return max(0.0, min(1.0, cov / var)) if var > 1e-12 else 0.0

    def _fit(self, j: int, x: float) -> float:
        if self._fits is None:          # once per batch of observations, not per request and draft
            self._fits = [(s[1] / s[0], s[2] / s[0], self.slope(j)) if s[0] > 0 else None
                          for j, s in enumerate(self._sums)]
        fit = self._fits[j]
        if fit is None:         # no pair reached this draft index yet (proposals cut short by max_tokens)
            return x
        mx, my, beta = fit
        return my + beta * (x - mx)
