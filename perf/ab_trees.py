"""A benchmark run in a baseline tree and in this tree on one machine, alternating, its JSON rows side by side:
for changes no switch can turn off (fused glue, removed launches), the same-call comparison an env flag
gives the others.

    python perf/ab_trees.py --pack REV                 here: git archive REV -> .ab/REV (carry `.ab`)
    python perf/ab_trees.py --base .ab/REV [--rounds 2] --json model_decode.json --key graph_ms --by batch \\
        -- perf/bench_model_decode.py --load-format dummy --batches 64 128 --dense-weights bf16+fp8

Each round runs the benchmark once in the baseline (cwd and PYTHONPATH its tree, deepinfer.kernels /
.recipe / .ensemble linked as perf/device_env.sh links them) and once in this tree, each writing its JSON
into its own $OUT folder; the table prints every row's key per round and the median ratio base / this
(> 1: this tree is faster where the key is a time).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def pack(rev: str) -> str:
    out = os.path.join(REPO, ".ab", rev)
    os.makedirs(out, exist_ok=True)
    archive = subprocess.run(["git", "-C", REPO, "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", out], input=archive, check=True)
    print(f"packed {rev} into {out} ({len(archive) / 2**20:.1f} MiB); carry '.ab'")
    return out


def run_in(tree: str, argv: list[str], out: str) -> None:
    for pkg in ("kernels", "recipe", "ensemble"):          # (this tree: its install or device_env.sh's links)
        link = os.path.join(tree, "deepinfer", pkg)
        if os.path.realpath(tree) != REPO and not os.path.lexists(link):
            os.symlink(os.path.join("..", pkg), link)
    site = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.realpath(p) != REPO]
    env = dict(os.environ, OUT=out, PYTHONPATH=os.pathsep.join([tree] + site), PYTHONUNBUFFERED="1")
    os.makedirs(out, exist_ok=True)
    subprocess.run([sys.executable] + argv, cwd=tree, env=env, check=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pack", help="write git archive REV into .ab/REV and stop")
    p.add_argument("--base", help="the baseline tree (.ab/REV)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", default="model_decode.json", help="the JSON file the benchmark saves in $OUT")
    p.add_argument("--key", default="graph_ms", help="the field of its rows compared")
    p.add_argument("--by", default="batch", help="the field naming a row")
    p.add_argument("bench", nargs=argparse.REMAINDER, help="-- the benchmark script (relative to a tree) and its args")
    a = p.parse_args()
    if a.pack:
        pack(a.pack)
        return
    argv = [x for x in a.bench if x != "--"]
    assert a.base and argv, "--base and a benchmark after -- are needed"
    root = os.environ.get("OUT", "/tmp/ab")
    trees = {"base": os.path.abspath(a.base), "this": REPO}
    got: dict[str, dict[str, list[float]]] = {"base": {}, "this": {}}
    for r in range(a.rounds):
        for name, tree in trees.items():
            out = os.path.join(root, f"{name}{r}")
            print(f"=== round {r + 1}: {name} ({tree})", flush=True)
            run_in(tree, argv, out)
            for row in json.load(open(os.path.join(out, a.json)))["rows"]:
                got[name].setdefault(str(row[a.by]), []).append(float(row[a.key]))
    print(f"\n{a.by:>8} {'base ' + a.key:>24} {'this ' + a.key:>24} {'base / this':>12}")
    summary = []
    for k in got["this"]:
        b, t = got["base"].get(k, []), got["this"][k]
        ratio = statistics.median(b) / statistics.median(t) if b else float("nan")
        print(f"{k:>8} {' '.join(f'{v:.3f}' for v in b):>24} {' '.join(f'{v:.3f}' for v in t):>24} {ratio:>12.3f}")
        summary.append(dict(row=k, base=b, this=t, base_over_this=ratio))
    with open(os.path.join(root, "ab_trees.json"), "w") as f:
        json.dump(dict(base=a.base, bench=argv, key=a.key, rows=summary), f, indent=1)


if __name__ == "__main__":
    main()
