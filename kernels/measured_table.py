"""Reading the kernels' measured choice tables (JSON written by the perf/ benchmarks): {"device": the GPU model
they were measured on, "rows": [{"n", "k", "m", ...}, ...]}, grouped by weight shape for lookups by M.

    rows_by_shape(path, row=lambda r: r)   -> (device or None, {(N, K): [row(r), ...] by ascending M})
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable


def rows_by_shape(path: str, row: Callable[[dict], object] = lambda r: r) -> tuple[str | None, dict]:
    """The table at path ((None, {}) where unset or absent); `row` maps each row to what the caller keeps,
    None to drop it."""
    if not path or not os.path.exists(path):
        return None, {}
    with open(path) as f:
        t = json.load(f)
    out: dict = {}
    for r in sorted(t["rows"], key=lambda r: r["m"]):
        kept = row(r)
        if kept is not None:
            out.setdefault((r["n"], r["k"]), []).append(kept)
    return t.get("device"), out
