"""DSpark speculative decoding: tokens/s and engine steps with and without drafts, batch 1 and 16.

    python perf/spec_decode.py [--checkpoint DIR] [--device cpu] [--prompt-len 32] [--output-len 32]
                               [--threshold 0.5] [--batches 1 16]

Without --checkpoint it builds the tiny preset into a temp folder. Each configuration runs the
same prompts through LLM.generate (greedy, ignore_eos) after a warm-up, in one process, and prints
the ratios to the run without drafts, the mean accepted length (tokens per verifying request-step)
and the acceptance rate from the engine stats. Random weights: the draft blocks were never trained
against the backbone, so acceptance is near zero and the drafts are pure cost here; the figure that
matters on real weights is the mean accepted length.

Tiny preset, CPU (2 shared cores, loaded), prompt 32, output 16, after a warm-up:
    batch  config            tok/s  x tok/s  steps  verified  acc.rate  mean acc len  same ids
    1      off                40.6    1.00     16        0       -          -           True
    1      dspark t=0.5       27.9    0.69     15        5     0.200      1.200         True
    1      dspark t=0 (all)   26.3    0.65     15       58     0.017      1.077         True
    16     off               386.0    1.00     16        0       -          -           True
    16     dspark t=0.5      194.4    0.50     16      121     0.050      1.052         True
    16     dspark t=0 (all)  139.5    0.36     16      931     0.011      1.046         True
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_throughput import default_checkpoint  # noqa: E402


def measure(llm, batch: int, prompt_len: int, output_len: int, vocab: int, seed: int = 0) -> dict:
    from deepinfer import SamplingParams
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab - 300) for _ in range(prompt_len)] for _ in range(batch)]
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))   # warm-up
    before = llm.engine.stats.snapshot()["counters"]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    c = llm.engine.stats.snapshot()["counters"]
    d = {k: c[k] - before[k] for k in c}
    tokens = sum(len(o.token_ids) for o in outs)
    steps, verified = d["spec_verify_steps_total"], d["spec_draft_tokens_verified_total"]
    acc = d["spec_draft_tokens_accepted_total"]
    return {"tok_s": tokens / dt, "steps": d["steps_total"], "tokens": tokens, "ids": [o.token_ids for o in outs],
            "mean_acc_len": 1 + acc / steps if steps else float("nan"),
            "acc_rate": acc / verified if verified else float("nan"), "verified": verified,
            "proposed": d["spec_draft_tokens_proposed_total"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--threshold", type=float, default=0.5)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    a = ap.parse_args()
    from deepinfer import LLM
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = a.checkpoint or default_checkpoint(Path(tmp), "tiny")
        base = dict(device=a.device, max_num_seqs=max(a.batches), max_num_batched_tokens=2048)
        llms = {"off": LLM(ckpt, **base),
                f"dspark t={a.threshold}": LLM(ckpt, **base, speculative="dspark", spec_confidence_threshold=a.threshold),
                "dspark t=0 (all 5)": LLM(ckpt, **base, speculative="dspark", spec_confidence_threshold=0.0)}
        vocab = llms["off"].engine.vocab_size
        for llm in llms.values():   # warm-up: one full batch-1 run each (first-touch costs are large on CPU)
            measure(llm, 1, a.prompt_len, a.output_len, vocab, seed=1)
        print(f"{'batch':>5} {'config':>20} {'tok/s':>8} {'steps':>6} {'x tok/s':>8} {'x steps':>8} "
              f"{'verified':>8} {'acc.rate':>8} {'mean acc len':>12} {'same ids':>8}")
        for b in a.batches:
            ref = None
            for name, llm in llms.items():
                r = measure(llm, b, a.prompt_len, a.output_len, vocab)
                ref = ref or r
                print(f"{b:>5} {name:>20} {r['tok_s']:>8.1f} {r['steps']:>6} {r['tok_s'] / ref['tok_s']:>8.2f} "
                      f"{r['steps'] / ref['steps']:>8.2f} {r['verified']:>8} {r['acc_rate']:>8.3f} "
                      f"{r['mean_acc_len']:>12.3f} {str(r['ids'] == ref['ids']):>8}")


if __name__ == "__main__":
    main()
