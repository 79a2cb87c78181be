"""Replayed acceptance: measure the verification policies without trained draft weights.

With random weights the DSpark blocks were never trained against the backbone, so nothing is
accepted and every policy looks alike. In this benchmark mode (EngineArgs.spec_replay_accepted_length)
the engine runs for real (verify steps of the chosen lengths, rollback, proposals), but each
proposal's confidences and its acceptance outcome are drawn from a stated distribution:

    c_k ~ Beta(m * kappa, (1 - m) * kappa), k = 1..K, independently      (mean m, concentration kappa)
    draft k is accepted, given drafts 1..k-1 were, with probability c_k  (the confidences are calibrated)
    L = the number of leading drafts accepted; a step verifying v drafts accepts min(L, v) of them

With regime_tokens = S > 0 a request's confidences persist: positions fall into regimes of S tokens (a
per-request offset staggers them), one confidence vector is drawn per regime and every proposal
anchored in it reuses it, with fresh acceptance draws (the text's local difficulty lasting S tokens).
Each proposal's confidences keep the same distribution, so the mean accepted length and the bound
below are unchanged; consecutive proposals (a few positions apart) then mostly share their
confidences, the case DeepInfer's budget from the previous proposal's confidences is built for.
S = 0 (the default): independent per proposal.

m solves 1 + sum_{j=1..K} m^j = the mean accepted length of verify-all (tokens per verify step):
3.5 of K = 5 is V4.1-Flash DSpark-5 with thinking on (0.776). kappa = 2 spreads the confidences
widely (a request-step with c = 0.95 next to one with 0.3), which is what the scheduler exploits;
larger kappa makes every request alike (the policies then converge). The accepted drafts are the
proposed draft ids themselves, and the token after them is the real sample at that row.

Each proposal's draws are a pure function of (seed, request id, anchor position) (hashed, vectorized
over a step's proposals; Beta draws by a quantile table): engines running
different policies over the same requests meet the same outcome wherever they propose at the same
position (common random numbers), so their differences are the policies', not the draws'.
"""

from __future__ import annotations

import zlib

import numpy as np


def survival_mean_for(mean_accepted_length: float, num_drafts: int) -> float:
    """m with 1 + sum_{j=1..K} m^j = mean_accepted_length (bisection; K = num_drafts)."""
    target = mean_accepted_length - 1.0
    if not 0.0 <= target < num_drafts:
        raise ValueError(f"mean accepted length must be in [1, {1 + num_drafts}), got {mean_accepted_length}")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(mid ** j for j in range(1, num_drafts + 1)) < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


class ReplayedAcceptance:
    def __init__(self, mean_accepted_length: float, num_drafts: int, concentration: float = 2.0,
                 seed: int = 0, regime_tokens: int = 0) -> None:
        if regime_tokens < 0:
            raise ValueError(f"regime_tokens must be >= 0, got {regime_tokens}")
        self.mean_accepted_length = mean_accepted_length
        self.num_drafts = num_drafts
        self.m = survival_mean_for(mean_accepted_length, num_drafts)
        self.concentration = concentration
        self.seed = seed
        self.regime_tokens = regime_tokens
        self._quantiles: np.ndarray | None = None

    def draw(self, keys: list[tuple[str, int]]) -> tuple[list[list[float]], list[int]]:
        """(request id, anchor position) per proposal -> (confidence logits [n][K], accepted-if-verified
        lengths L [n]). Vectorized over the proposals: every random number is a hash of (seed, request,
        position or regime, stream, draft index), and a confidence is the Beta quantile of its uniform
        (a table built once), so a draw costs microseconds per proposal. It runs on the host inside the
        step loop: per-proposal generators took ~3 ms per batch-64 draw on a dev CPU, host time an
        overlapped step at batch 64 (12-17 ms on the H200) cannot spare."""
        k, S = self.num_drafts, self.regime_tokens
        if not keys:
            return [], []
        req = np.array([zlib.crc32(r.encode()) for r, _ in keys], dtype=np.uint64)
        pos = np.array([p for _, p in keys], dtype=np.int64)
        if S:       # the regime's confidences in place of the proposal's own (same distribution)
            where = (pos + (req % np.uint64(S)).astype(np.int64)) // S
            c = self._beta(_uniforms(self.seed, req, where, 1, k))
        else:
            c = self._beta(_uniforms(self.seed, req, pos, 0, k))
        u = _uniforms(self.seed, req, pos, 2, k)
        c = c.clip(1e-6, 1 - 1e-6)
        accepted = u < c                                                     # draft j given 1..j-1
        lengths = np.cumprod(accepted, axis=1).sum(axis=1)
        logits = np.log(c) - np.log1p(-c)
        return logits.tolist(), lengths.tolist()

    def _beta(self, u: np.ndarray) -> np.ndarray:
        """Beta(m kappa, (1 - m) kappa) quantiles of the uniforms u, from a table of QUANTILES order
        statistics (built on first use, interpolated linearly)."""
        if self._quantiles is None:
            rng = np.random.default_rng([self.seed, 7])
            draws = np.sort(rng.beta(self.m * self.concentration, (1 - self.m) * self.concentration, size=QUANTILES * 16))
            self._quantiles = np.concatenate([[0.0], draws[8::16], [1.0]])          # q(0) = 0, q(1) = 1
        grid = u * (len(self._quantiles) - 1)
        i = np.minimum(grid.astype(np.int64), len(self._quantiles) - 2)
        w = grid - i
        return self._quantiles[i] * (1 - w) + self._quantiles[i + 1] * w

    def best_accepted_length_ratio(self, fewer: float, samples: int = 200_000) -> float:
        """The most accepted length, as a fraction of verify-all's, that any policy deciding from the
        confidences can keep while verifying `fewer` (a fraction) fewer drafts than verify-all, under
        this distribution. Verifying draft j gains its survival a_j in expectation (calibration), so
        the best cut drops the lowest survivals of all proposals pooled (a prefix of each, since a_j
        falls with j); pooling over every step bounds any per-step budget. Monte Carlo, fixed seed."""
        if not 0.0 <= fewer <= 1.0:
            raise ValueError(f"fewer must be in [0, 1], got {fewer}")
        rng = np.random.default_rng(self.seed)
        c = rng.beta(self.m * self.concentration, (1 - self.m) * self.concentration, size=(samples, self.num_drafts))
        a = np.sort(np.cumprod(c.clip(1e-6, 1 - 1e-6), axis=1).ravel())
        full = samples + a.sum()
        return float((full - a[:int(round(fewer * a.size))].sum()) / full)

    def __repr__(self) -> str:
        return (f"ReplayedAcceptance(mean accepted length {self.mean_accepted_length} of {self.num_drafts} "
                f"drafts: m = {self.m:.3f}, kappa = {self.concentration}, regimes of {self.regime_tokens} tokens)")


QUANTILES = 1 << 16
_GOLDEN, _M1, _M2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer (uint64, wrapping): a bijection that scrambles every input bit."""
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def _uniforms(seed: int, req: np.ndarray, where: np.ndarray, stream: int, width: int) -> np.ndarray:
    """[n, width] uniforms in [0, 1), each a hash of (seed, req[i], where[i], stream, j)."""
    with np.errstate(over="ignore"):
        h = _mix(np.uint64(seed) * _GOLDEN + np.uint64(stream + 1))
        h = _mix(h ^ req)
        h = _mix(h ^ where.astype(np.uint64))
        x = _mix(h[:, None] ^ (np.arange(1, width + 1, dtype=np.uint64) * _GOLDEN)[None, :])
    return (x >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def expected_accepted_length(m: float, num_drafts: int, verified: int | None = None) -> float:
    """1 + sum_{j<=v} m^j: tokens per step verifying the first v drafts (all by default)."""
    v = num_drafts if verified is None else verified
    return 1.0 + sum(m ** j for j in range(1, v + 1)) if v > 0 else 1.0
