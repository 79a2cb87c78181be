"""tensor_version(t): t's in-place write counter, for caches of values derived from a weight.

An inference tensor keeps no version counter: taken as never written in place (-1)."""

from __future__ import annotations

import torch


def tensor_version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:
        return -1
