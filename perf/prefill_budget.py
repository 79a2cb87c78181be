"""A burst of prompts into an idle engine, with the prefill-only step budget at the plain budget (every
step a 2,048-token chunk) and larger (EngineArgs.max_prefill_only_tokens), side by side in one run:
time to the last first token, TTFT p50, prompt tokens/s through the prefill, and the steps it took.

    python perf/prefill_budget.py [--checkpoint DIR | --preset full-width-ep8|release-ep8|tiny] [--device cuda|cpu]
                                  [--load-format dummy] [--prompts 8] [--prompt-len 2048]
                                  [--budget 2048] [--prefill-only 2048 8192] [--json FILE]

H200 (random weights drawn on the device, config.json written here from the preset):
    python perf/prefill_budget.py --preset release-ep8 --device cuda --load-format dummy --prompts 8 --prompt-len 2048
Each engine gets one untimed burst first (kernel builds, first-touch allocations), then the timed one;
engines are built one at a time and torn down before the next. The first --prefill-only value is the
baseline of the ratios.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchutil import release_engine_memory  # noqa: E402
from engine_throughput import default_checkpoint  # noqa: E402
from spec_decode import Progress, config_only_checkpoint  # noqa: E402


def burst(engine, n: int, prompt_len: int, vocab: int, seed: int, label: str | None = None) -> dict:
    """n prompts added at once, 2 output tokens each: per-request time to the first token."""
    from deepinfer import SamplingParams
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    for i in range(n):
        engine.add_request(f"p{seed}-{i}", [rng.randrange(3, vocab - 300) for _ in range(prompt_len)], params)
    first, steps = {}, 0
    bar = Progress(label, n) if label else None
    while engine.has_unfinished_requests():
        outs = engine.step()
        steps += 1
        for out in outs:
            if out.new_token_ids and out.request_id not in first:
                first[out.request_id] = time.perf_counter() - t0
                if bar is not None:
                    bar.update(1)
    if bar is not None:
        bar.close()
    last = max(first.values())
    return {"ttft_last_s": last, "ttft_p50_s": statistics.median(first.values()),
            "prefill_tok_s": n * prompt_len / last, "steps": steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint")
    ap.add_argument("--preset", default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--load-format", default="safetensors", choices=["safetensors", "dummy"])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    ap.add_argument("--prefill-only", type=int, nargs="+", default=[2048, 8192], help="max_prefill_only_tokens values")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    from deepinfer import LLM
    tmp = Path(tempfile.mkdtemp())
    preset = a.preset or ("full-width-ep8" if a.device.startswith("cuda") else "tiny")
    ckpt = a.checkpoint or (config_only_checkpoint(tmp, preset) if a.load_format == "dummy"
                            else default_checkpoint(tmp, preset))
    blocks_per = -(-(a.prompt_len + 8) // 64) + 1
    res = {}
    for p in a.prefill_only:
        llm = LLM(ckpt, device=a.device, load_format=a.load_format, seed=0, max_num_seqs=a.prompts,
                  max_num_batched_tokens=a.budget, max_prefill_only_tokens=max(p, a.budget),
                  num_cache_blocks=2 * a.prompts * blocks_per + 64)
        eng = llm.engine
        burst(eng, a.prompts, a.prompt_len, eng.vocab_size, seed=99)                  # untimed
        r = res[p] = burst(eng, a.prompts, a.prompt_len, eng.vocab_size, seed=0, label=f"prefill-only {p}")
        print(f"prefill-only {p:>6}: last first token {r['ttft_last_s'] * 1e3:9.1f} ms, TTFT p50 "
              f"{r['ttft_p50_s'] * 1e3:9.1f} ms, {r['prefill_tok_s']:9.0f} prompt tok/s, {r['steps']} steps", flush=True)
        eng.shutdown()
        del llm, eng
        release_engine_memory()
    base = res[a.prefill_only[0]]
    print(f"\n{a.prompts} x {a.prompt_len} prompt tokens, max_num_batched_tokens {a.budget} ({preset}, {a.device}):")
    print(f"{'prefill-only':>12} {'last TTFT ms':>12} {'x base':>7} {'p50 TTFT ms':>11} {'tok/s':>9} {'x base':>7} {'steps':>5}")
    for p, r in res.items():
        print(f"{p:>12} {r['ttft_last_s'] * 1e3:12.1f} {base['ttft_last_s'] / r['ttft_last_s']:7.2f} "
              f"{r['ttft_p50_s'] * 1e3:11.1f} {r['prefill_tok_s']:9.0f} {r['prefill_tok_s'] / base['prefill_tok_s']:7.2f} "
              f"{r['steps']:5d}")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps({"args": vars(a), "results": res}, indent=1))


if __name__ == "__main__":
    main()
