"""Model-step throughput of the torch reference path: prefill and decode tokens/s for the tiny and
small presets (a benchmark; no asserts). Checkpoints are generated on first use into
$DEEPINFER_CACHE/checkpoints (default ~/.cache/deepinfer).

    .venv/bin/python perf/model_step.py [--presets tiny small] [--device cpu|cuda] [--prompt-len 512]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from deepinfer.cache.model_caches import ModelCaches
from deepinfer.checkpoint.generator import make_checkpoint
from deepinfer.model.loader import load_model
from deepinfer.model.simple import make_batch


def checkpoint(preset: str) -> Path:
    root = Path(os.environ.get("DEEPINFER_CACHE", Path.home() / ".cache" / "deepinfer")) / "checkpoints"
    out = root / f"{preset}-seed0"
    if not (out / "model.safetensors.index.json").is_file():
        make_checkpoint(preset, 0, out, progress=False)
    return out


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def bench(preset: str, device: str, prompt_len: int, batch: int, decode_steps: int) -> str:
    model = load_model(checkpoint(preset), device, progress=False)
    args = model.args
    bt = 64
    nb = (prompt_len + decode_steps + bt) // bt
    caches = ModelCaches.allocate(args, batch, batch * nb, bt, device)
    tables = torch.arange(batch * nb).view(batch, nb)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 100000, (prompt_len,), generator=g).tolist() for _ in range(batch)]
    ng = args.engram_max_ngram_size
    # prefill: all sequences in one step
    b = make_batch([(p, 0, []) for p in prompts], list(range(batch)), tables, ng, device)
    sync(device)
    t = time.perf_counter()
    out = model(b, caches)
    sync(device)
    t_pre = time.perf_counter() - t
    toks = [[int(x)] for x in out.logits.argmax(-1)]
    hist = [p[:] for p in prompts]
    t = time.perf_counter()
    for s in range(decode_steps):
        b = make_batch([(toks[i][-1:], prompt_len + s, hist[i]) for i in range(batch)], list(range(batch)),
                       tables, ng, device)
        out = model(b, caches)
        nxt = out.logits.argmax(-1).tolist()
        for i in range(batch):
            hist[i].append(toks[i][-1])
            toks[i].append(nxt[i])
    sync(device)
    t_dec = time.perf_counter() - t
    return (f"{preset:6s} batch {batch:2d}: prefill {batch * prompt_len / t_pre:9.1f} tok/s ({t_pre * 1e3:.0f} ms for "
            f"{batch}x{prompt_len}), decode {batch * decode_steps / t_dec:8.1f} tok/s "
            f"({t_dec / decode_steps * 1e3:.1f} ms/step)")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--presets", nargs="+", default=["tiny", "small"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--batches", nargs="+", type=int, default=[1, 4])
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    print(f"model step, torch reference path, device {a.device}, {torch.get_num_threads()} thread(s)")
    for preset in a.presets:
        for batch in a.batches:
            print(bench(preset, a.device, a.prompt_len, batch, a.decode_steps), flush=True)


if __name__ == "__main__":
    main()
