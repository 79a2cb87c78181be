"""exp(t) for t <= 0 from IEEE basic operations only, in two forms with the same steps:

    exp_nonpositive(t)          a Python float (the host's verification policies, spec/policy.py)
    exp_nonpositive_tensor(t)   float64 tensor ops (their device form inside overlapped verify
                                steps, spec/device_verify.py)

Why: the policies' survivals must come out the same bits on the host and on the device, or the two
paths verify different drafts near a tie (and a "sampled" request's tokens follow the verified
counts). A library exp does not give that: torch's vectorized exp, CPU torch's scalar tail, CUDA's and
libm's differ in the last bit (on an AVX-512 Xeon, 2026-12-06, torch.exp and math.exp disagreed on
4.5% of float64 inputs). Each step below (one multiply, add, subtract, floor or power-of-two scale at
a time, never fused) is correctly rounded by IEEE 754 wherever it runs, so both forms agree exactly.

Cody-Waite reduction t = k ln2 + r (|r| <= ln2 / 2, ln2 split so k * LN2_HI is exact), a degree-13
Taylor polynomial in Horner form (truncation < 1e-17), then the exact scale by 2^k: within 2 ulp of
exp(t). t is clamped at -700 (2^k stays a normal double; exp(-700) ~ 1e-304 is a survival of 0 for
every purpose here).
"""

from __future__ import annotations

import math

import torch

LN2_HI = 6.93147180369123816490e-01      # fdlibm's split: 32 significant bits, k * LN2_HI exact
LN2_LO = 1.90821492927058770002e-10
INV_LN2 = 1.44269504088896338700e+00
FLOOR = -700.0
# 1/13!, 1/12!, ..., 1/1!, 1/0!: Horner from the highest power
COEFFS = tuple(1.0 / math.factorial(n) for n in range(13, -1, -1))


def exp_nonpositive(t: float) -> float:
    if t != t:                  # NaN (a broken confidence head) stays NaN, as libm's exp and the tensor form give
        return t
    t = max(t, FLOOR)
    k = math.floor(t * INV_LN2 + 0.5)
    r = (t - k * LN2_HI) - k * LN2_LO
    p = COEFFS[0]
    for c in COEFFS[1:]:
        p = p * r + c
    return math.ldexp(p, k)


def exp_nonpositive_tensor(t: torch.Tensor) -> torch.Tensor:
    """float64 t (<= 0) -> exp_nonpositive of each element, bit for bit."""
    t = t.to(torch.float64).clamp_min(FLOOR)
    k = torch.floor(t * INV_LN2 + 0.5)
    r = (t - k * LN2_HI) - k * LN2_LO
    p = torch.full_like(r, COEFFS[0])
    for c in COEFFS[1:]:
        p = p * r + c
    two_k = ((k.to(torch.int64) + 1023) << 52).view(torch.float64)     # 2^k, exact (k >= -1010)
    return p * two_k
