"""deepinfer-make-checkpoint: a random-weight V4.1 checkpoint in the release format.

    deepinfer-make-checkpoint --preset tiny|small|full-width-layers|full-width-ep8|release-ep8 --seed N --out DIR
"""

from __future__ import annotations

import argparse
import sys
import time


def main(argv=None) -> int:
    from deepinfer.checkpoint.generator import PRESETS, make_checkpoint

    p = argparse.ArgumentParser(prog="deepinfer-make-checkpoint", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    t0 = time.time()
    out = make_checkpoint(a.preset, a.seed, a.out, progress=sys.stderr.isatty())
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    print(f"deepinfer-make-checkpoint: {a.preset} (seed {a.seed}) -> {out} ({size / 2**20:.1f} MiB, {time.time() - t0:.1f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
