"""Counter-based random streams: a request's randomness is a pure function of (seed, position).

No generator state is carried between steps or shared between requests, so a token drawn for a
request does not depend on what else is in the batch, on preemption and recomputation, or on how
many drafts were verified before it. One uniform per sampled token is all the sampler needs
(inverse-CDF sampling, sampler.py).

The mixer is SplitMix64 (Steele, Lea, Flood 2014, the finalizer of Java's SplittableRandom),
computed on Python ints so it is exact on every device and platform.

Speculative sampling (sample/rejection.py) needs more than one draw per position; each purpose has
its own stream, keyed by (seed, purpose, position), never by a row or a verify length:

    SAMPLE   the token itself (inverse CDF of the target); the stream plain decoding uses
    DRAFT    a sampled draft at its position (DSpark proposer, spec_acceptance="sampled")
    ACCEPT   the accept test u < p(d) / q(d) of the draft at its position
    RESIDUAL the resample from norm(max(0, p - q)) after a rejection at that position
"""

from __future__ import annotations

import secrets

import torch

_MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def stream_uniform(seed: int, position: int) -> float:
    """U[0, 1) with 53 random bits, a pure function of (seed, position)."""
    h = splitmix64(splitmix64(seed & _MASK64) ^ (position & _MASK64))
    return (h >> 11) * (1.0 / (1 << 53))


SAMPLE, DRAFT, ACCEPT, RESIDUAL = 0, 1, 2, 3


def purpose_seed(seed: int, purpose: int) -> int:
    """The seed of a purpose's stream; SAMPLE keeps the request's own (plain decoding unchanged)."""
    return seed if purpose == SAMPLE else splitmix64((seed & _MASK64) ^ (purpose * 0xD1B54A32D192ED03 & _MASK64))


def uniforms(seeds: list[int], positions: list[int], purpose: int = SAMPLE) -> torch.Tensor:
    """[N] float64 (CPU): one uniform per row."""
    return torch.tensor([stream_uniform(purpose_seed(s, purpose), p) for s, p in zip(seeds, positions)],
                        dtype=torch.float64)


def resolve_seed(seed: int | None) -> int:
    """A request without a seed gets a fresh one at admission; from then on it is deterministic."""
    return secrets.randbits(63) if seed is None else int(seed)
