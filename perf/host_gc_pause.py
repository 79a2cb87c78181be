"""What a full Python garbage collection costs a serving process, with and without the engine's startup objects
frozen (deepinfer/host_gc.py), side by side in one run: an engine built on a checkpoint and warmed by a few
requests, then the best of five gc.collect() pauses before gc.freeze() and after it, with the tracked-object
counts. A full collection holds the GIL: the engine thread launches nothing and the frontends stream nothing
meanwhile.

    python perf/host_gc_pause.py [--checkpoint DIR | --preset tiny] [--requests 16]
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def full_pause_ms(reps: int = 5) -> float:
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        gc.collect()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--checkpoint")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--requests", type=int, default=16)
    a = p.parse_args()
    from bench_model_decode import build_checkpoint
    from benchutil import save_json
    from deepinfer import LLM, SamplingParams, host_gc
    ckpt = a.checkpoint or build_checkpoint(a.preset)
    t = time.time()
    llm = LLM(ckpt)
    prompts = [[1000 + i, 2000 + i, 3000 + i] for i in range(a.requests)]
    llm.generate(prompts, SamplingParams(max_tokens=8))
    print(f"engine on {ckpt} built and warmed in {time.time() - t:.0f} s", flush=True)
    tracked = len(gc.get_objects())
    before = full_pause_ms()
    frozen = host_gc.freeze_startup_heap()
    llm.generate(prompts, SamplingParams(max_tokens=8))
    after, left = full_pause_ms(), len(gc.get_objects())
    host_gc.unfreeze()
    print(f"{'':>28} {'objects tracked':>16} {'full collection ms':>19}")
    print(f"{'startup heap in the walk':>28} {tracked:>16,} {before:>19.2f}")
    print(f"{'frozen (host_gc)':>28} {left:>16,} {after:>19.2f}")
    print(f"full collection {before / max(after, 1e-6):.0f}x shorter frozen ({frozen:,} objects frozen)")
    print("saved", save_json("host_gc_pause", {"checkpoint": ckpt, "tracked": tracked, "frozen": frozen,
                                                "pause_ms": before, "frozen_pause_ms": after, "left": left}))


if __name__ == "__main__":
    main()
