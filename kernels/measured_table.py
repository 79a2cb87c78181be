"""Reading the kernels' measured choice tables (JSON written by the perf/ benchmarks), grouped by weight shape
for lookups by M. A file holds one GPU model's table, {"device", "rows": [{"n", "k", "m", ...}, ...]}, or
several, {"tables": [{"device", "rows"}, ...]} (a table measured on another GPU model is added beside the
others, not over them).

    rows_by_shape(path, row=lambda r: r, device=None)   -> (device or None, {(N, K): [row(r), ...] by ascending M})
    merge_table(path, table)                             the file with `table` ({"device", "rows", ...}) in place of
                                                         that device's (added where it had none); the old table's
                                                         rows of (N, K, M) points the new one did not measure stay
                                                         (a run of a few shapes or M's adds them to the table)
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable


def _tables(path: str) -> list[dict]:
    if not path or not os.path.exists(path):
        return []
    with open(path) as f:
        t = json.load(f)
    return t["tables"] if "tables" in t else [t]


def rows_by_shape(path: str, row: Callable[[dict], object] = lambda r: r,
                  device: str | None = None) -> tuple[str | None, dict]:
    """The table at path for GPU model `device` (None: the file's first table); (None, {}) where unset, absent or
    not measured on that device. `row` maps each row to what the caller keeps, None to drop it."""
    tables = _tables(path)
    t = next((t for t in tables if device is None or t.get("device") == device), None)
    if t is None:
        return None, {}
    out: dict = {}
    for r in sorted(t["rows"], key=lambda r: r["m"]):
        kept = row(r)
        if kept is not None:
            out.setdefault((r["n"], r["k"]), []).append(kept)
    return t.get("device"), out


def merge_table(path: str, table: dict) -> None:
    old = _tables(path)
    measured = {(r["n"], r["k"], r["m"]) for r in table["rows"]}
    kept = [r for t in old if t.get("device") == table["device"] for r in t["rows"]
            if (r["n"], r["k"], r["m"]) not in measured]
    table = dict(table, rows=kept + list(table["rows"]))
    tables = [t for t in old if t.get("device") != table["device"]] + [table]
    with open(path, "w") as f:
        json.dump({"tables": sorted(tables, key=lambda t: t.get("device") or "")}, f, indent=1)
