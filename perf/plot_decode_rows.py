"""Grouped bars of bench_model_decode.py's rows (graph ms a step by batch), one bar a variant of the run
(MoE path, mHC variant, skinny table, index-key format), from the model_decode.json files a device call brought back:

    python perf/plot_decode_rows.py OUT.png model_decode.json [more.json ...] [--title TEXT]

Rows of several files are drawn side by side, labelled by file order (f0, f1, ...) when more than one.
"""

from __future__ import annotations

import argparse
import json
import textwrap

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def label(row: dict) -> str:
    parts = [row.get("moe_path") or "", json.dumps(row["mhc_variant"]) if row.get("mhc_variant") else "",
             row.get("skinny_table") or "", f"{row['index_k']} keys" if row.get("index_k") else ""]
    return " ".join(p for p in parts if p and p != "default") or "default"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("jsons", nargs="+")
    ap.add_argument("--title", default="decode step (CUDA graph)")
    a = ap.parse_args()
    series: dict[str, dict[int, float]] = {}
    for i, path in enumerate(a.jsons):
        for r in json.load(open(path))["rows"]:
            name = label(r) if len(a.jsons) == 1 else f"f{i} {label(r)}"
            series.setdefault(name, {})[r["batch"]] = r["graph_ms"]
    batches = sorted({b for s in series.values() for b in s})
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(2 + 1.6 * len(batches), 4))
    for j, (name, s) in enumerate(series.items()):
        xs = [i + j * width for i, b in enumerate(batches) if b in s]
        ys = [s[b] for b in batches if b in s]
        bars = ax.bar(xs, ys, width, label=name)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.set_xticks([i + width * (len(series) - 1) / 2 for i in range(len(batches))], [f"batch {b}" for b in batches])
    ax.set_ylabel("ms a step")
    ax.set_title(textwrap.fill(a.title, 70), fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(a.out, dpi=120)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
