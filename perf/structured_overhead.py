"""Structured-output overhead: tokens/s at batch 16, constrained vs unconstrained, as a ratio (goal >= 0.85).

    python perf/structured_overhead.py [--checkpoint DIR] [--device cpu] [--batch 16] [--output-len 32]

Two measurements, in one process:

1. Engine: LLM.generate on `batch` requests with the same sampling (temperature 1, seeded), once
   without a constraint and once under a JSON schema whose string field the random-weight model
   stays in (so both runs keep the whole batch busy for output-len tokens: the ratio is the cost of
   the masks, not of shorter outputs). Tokens/s = output tokens / wall time.
2. Sampler alone: Sampler.sample on random [batch, V] logits, constrained (JSON schema) vs not:
   the per-step cost of bitmask fill + apply without the model. On a fast device the model step
   shrinks and this is the part that remains, so it bounds the ratio there.

Without --checkpoint the tiny preset (deepinfer.cli.make_checkpoint) or the shared v41-tiny-bf16
fixture is built into a temp folder (as perf/engine_throughput.py does).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

SCHEMA = {"type": "object", "properties": {"id": {"type": "integer"}, "text": {"type": "string"}},
          "required": ["id", "text"], "additionalProperties": False}


def engine_tokens_per_s(llm, batch: int, output_len: int, constrained: bool) -> tuple[float, int]:
    from deepinfer import SamplingParams
    from deepinfer.sampling_params import OutputConstraint

    c = OutputConstraint("json_schema", json.dumps(SCHEMA)) if constrained else None
    params = [SamplingParams(max_tokens=output_len, temperature=1.0, seed=i, constraint=c) for i in range(batch)]
    prompts = [[0, 1000 + 7 * i, 2000 + i, 3000] for i in range(batch)]
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t
    n = sum(len(o.token_ids) for o in outs)
    return n / dt, n


def sampler_step_ms(sampler, batch: int, constrained: bool, steps: int = 30) -> float:
    import torch

    from deepinfer.sample import SamplingRow
    from deepinfer.sampling_params import OutputConstraint, SamplingParams

    c = OutputConstraint("json_schema", json.dumps(SCHEMA)) if constrained else None
    states = [sampler.new_state(SamplingParams(seed=i, constraint=c)) for i in range(batch)]
    outs: list[list[int]] = [[] for _ in range(batch)]
    g = torch.Generator().manual_seed(0)
    logits = [torch.randn(batch, sampler.vocab_size, generator=g) for _ in range(4)]
    total = 0.0
    for step in range(steps):
        rows = [SamplingRow(states[i], outs[i], 10 + step) for i in range(batch)]
        t = time.perf_counter()
        toks = sampler.sample(logits[step % 4], rows).token_ids.tolist()
        total += time.perf_counter() - t
        for i, tok in enumerate(toks):
            outs[i].append(tok)
    return total / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    from deepinfer import LLM

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = args.checkpoint
        if ckpt is None:
            from engine_throughput import default_checkpoint
            ckpt = default_checkpoint(Path(tmp), "tiny")
        llm = LLM(ckpt, device=args.device, max_num_seqs=args.batch)
        engine_tokens_per_s(llm, args.batch, 4, True)       # warm-up (compiles the grammar, loads the vocab)
        engine_tokens_per_s(llm, args.batch, 4, False)
        free, cons = [], []
        for _ in range(args.repeats):                        # interleaved, best of: the machine is shared
            free.append(engine_tokens_per_s(llm, args.batch, args.output_len, False))
            cons.append(engine_tokens_per_s(llm, args.batch, args.output_len, True))
        f, c = max(free), max(cons)
        pairs = sorted(cs[0] / fs[0] for fs, cs in zip(free, cons))
        print(f"engine, batch {args.batch}, {args.output_len} tokens each ({args.device}), best of {args.repeats}:")
        print(f"  unconstrained  {f[0]:8.2f} tok/s  ({f[1]} tokens)")
        print(f"  json_schema    {c[0]:8.2f} tok/s  ({c[1]} tokens)")
        print(f"  ratio          {c[0] / f[0]:8.3f}   (goal >= 0.85; median of the interleaved pairs "
              f"{pairs[len(pairs) // 2]:.3f})")

        sampler = llm.engine.sampler
        sampler_step_ms(sampler, args.batch, True, 3)
        sf = min(sampler_step_ms(sampler, args.batch, False) for _ in range(2))
        sc = min(sampler_step_ms(sampler, args.batch, True) for _ in range(2))
        print(f"sampler alone, batch {args.batch}, V={sampler.vocab_size}:")
        print(f"  unconstrained  {sf:8.2f} ms/step")
        print(f"  json_schema    {sc:8.2f} ms/step  (+{sc - sf:.2f} ms for bitmask fill + apply)")


if __name__ == "__main__":
    main()
