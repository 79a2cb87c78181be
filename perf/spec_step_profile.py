"""Where a speculative decode step's time goes: no speculation against DSpark verify-all (replayed
acceptance), one engine at a time, at a steady batch: wall time per step, GPU kernel time per step
(torch profiler), the top kernels and host ops, and the Python functions by cumulative time (cProfile).

    python perf/spec_step_profile.py --preset full-width-ep8 --device cuda --load-format dummy \
        [--batch 1] [--steps 12] [--policies off all] [--out DIR]

The gap between wall time and GPU time per step is host work the GPU waits on; the cProfile list
says which Python code it is. Writes DIR/<policy>_b<batch>_{kernels,host,python}.txt and prints a summary.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchutil import release_engine_memory  # noqa: E402
from spec_decode import config_only_checkpoint  # noqa: E402

# "all" / "scheduler": the synchronous engine (every verify step resolved before the next schedule);
# "all-async": overlapped verify steps (CUDA's default with speculation since 2026-12-02, late)
POLICIES = {"off": {}, "all": {"spec_policy": "all", "async_scheduling": False},
            "scheduler": {"spec_policy": "scheduler", "async_scheduling": False},
            "all-async": {"spec_policy": "all", "async_scheduling": True}}


def start_batch(eng, batch: int, prompt_len: int, vocab: int, tag: str) -> None:
    from deepinfer import SamplingParams
    rng = random.Random(0)
    for i in range(batch):
        eng.add_request(f"{tag}-{i}", [rng.randrange(3, vocab - 300) for _ in range(prompt_len)],
                        SamplingParams(max_tokens=10_000, ignore_eos=True))


def profile_policy(ckpt: str, name: str, a, out: Path) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile
    from deepinfer import LLM
    extra = POLICIES[name]
    spec = dict(speculative="dspark", spec_replay_accepted_length=a.accepted_length) if name != "off" else {}
    llm = LLM(ckpt, device=a.device, max_num_seqs=max(a.batch, 8), max_num_batched_tokens=2048,
              load_format=a.load_format, seed=0, num_cache_blocks=a.num_cache_blocks,
              dense_weights=a.dense_weights, **spec, **extra)
    eng = llm.engine
    start_batch(eng, a.batch, a.prompt_len, eng.vocab_size, name)
    for _ in range(a.warm_steps):          # prefill, then steady decode (graphs warm)
        eng.step()
    sync = torch.cuda.synchronize if a.device.startswith("cuda") else (lambda: None)
    sync()
    tokens = 0
    t0 = time.perf_counter()
    for _ in range(a.steps):
        tokens += sum(len(o.new_token_ids) for o in eng.step())
    sync()
    wall = (time.perf_counter() - t0) / a.steps
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if a.device.startswith("cuda") else [])
    with profile(activities=acts) as prof:
        for _ in range(a.steps):
            eng.step()
        sync()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(a.steps):
        eng.step()
    sync()
    pr.disable()
    ka = prof.key_averages()
    dev_us = sum(e.self_device_time_total for e in ka) / a.steps if a.device.startswith("cuda") else 0.0
    n_kernels = sum(e.count for e in ka if e.self_device_time_total > 0) / a.steps
    tag = f"{name}_b{a.batch}"
    if a.device.startswith("cuda"):
        (out / f"{tag}_kernels.txt").write_text(ka.table(sort_by="self_device_time_total", row_limit=40))
    (out / f"{tag}_host.txt").write_text(ka.table(sort_by="self_cpu_time_total", row_limit=40))
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(60)
    (out / f"{tag}_python.txt").write_text(s.getvalue())
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(40)
    (out / f"{tag}_python_self.txt").write_text(s.getvalue())
    res = {"wall_ms": wall * 1e3, "gpu_ms": dev_us / 1e3, "kernels_per_step": n_kernels,
           "tokens_per_step": tokens / a.steps}
    print(f"[{name}] batch {a.batch}: {res['wall_ms']:.2f} ms/step wall, {res['gpu_ms']:.2f} ms/step GPU kernels, "
          f"{n_kernels:.0f} kernels/step, {res['tokens_per_step']:.2f} tokens/step", flush=True)
    eng.shutdown()
    del llm, eng
    release_engine_memory()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--load-format", default="dummy", choices=["safetensors", "dummy"])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dense-weights", default="auto", choices=["auto", "fp8", "bf16"], help="EngineArgs.dense_weights")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warm-steps", type=int, default=8)
    ap.add_argument("--accepted-length", type=float, default=3.5)
    ap.add_argument("--num-cache-blocks", type=int, default=512)
    ap.add_argument("--policies", nargs="+", default=["off", "all"], choices=list(POLICIES))
    ap.add_argument("--out", default="spec_profile")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = a.checkpoint or config_only_checkpoint(Path(tmp), a.preset)
        res = {n: profile_policy(ckpt, n, a, out) for n in a.policies}
    if "off" in res:
        for n, r in res.items():
            if n != "off":
                print(f"{n} / off: wall {r['wall_ms'] / res['off']['wall_ms']:.2f}x, GPU "
                      f"{r['gpu_ms'] / max(res['off']['gpu_ms'], 1e-9):.2f}x, host gap {r['wall_ms'] - r['gpu_ms']:.2f} "
                      f"vs {res['off']['wall_ms'] - res['off']['gpu_ms']:.2f} ms")


if __name__ == "__main__":
    main()
