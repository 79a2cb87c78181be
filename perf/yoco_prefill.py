"""YOCO prefill truncation (EngineArgs.yoco_prefill_keep_tokens, deepinfer/model/yoco.py): prefill
tokens/s with and without it, side by side in one run, and the drift it costs.

    python perf/yoco_prefill.py [--device cpu] [--keep 140] [--prompt-len 512] [--prompts 4]
                                [--fixtures v41-tiny v41-tiny-bf16]
    python perf/yoco_prefill.py --device cuda [--preset full-width-ep8] [--prompt-len 8192] [--prompts 4]

Throughput: the same engine settings without and with truncation, `--prompts` random prompts of
`--prompt-len` tokens prefilled (max_tokens 1) after one warm-up prompt; tokens/s and the ratio.
CPU: the tiny preset (10 layers, decoder = layers 6-9); CUDA: a preset's config with random weights
made on the device (load_format="dummy"; full-width-ep8 = real widths, one layer per role, decoder
= layers 4-6 of 7, so the gain is smaller than the release's 20 of 40 decoder layers).

Drift: teacher-forced logits (prefill, then 16 fed tokens) with truncation against exact mode:
  - CPU: the shared fixtures judged by ../shared/tools/check-parity against DeepSeek's reference
    outputs (exact and truncated, each its verdict line: the same scale as implementation noise,
    fixtures/README.md "Pass rules"), the way perf/prefix_replay_drift.py judges bounded replay;
  - both: truncated vs exact directly, per scored row max |diff| and top-1 agreement.
Only prompts longer than --keep are truncated (the fixtures' prompts are 18/145/300/695 tokens).

Measured (CPU, 2026-12-02; three runs of the default, 4 x 512 tokens):

    prefill tokens/s   exact 2,507-2,712   yoco 4,086-4,545   ratio 1.51-1.72x
    v41-tiny        exact PASS median 0.407 max 1.94 top1 63/68   yoco 140 PASS median 0.395 max 1.76 top1 64/68
    v41-tiny-bf16   exact PASS median 0.158 max 0.71 top1 68/68   yoco 140 PASS median 0.161 max 0.68 top1 68/68
    yoco vs exact: P=18 identical; P=145/300/695 max |diff| 0.6-3.0 (prefill row), top-1 101/102 rows
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from prefix_replay_drift import build, check  # noqa: E402

FED = 16


def random_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1000, 120000, length).tolist() for _ in range(n)]


def make_llm(ckpt: str, a, keep: int, cuda: bool, **kw):
    from deepinfer import LLM
    max_len = -(-(a.prompt_len + FED + 64) // 64) * 64
    common = dict(max_num_seqs=max(a.prompts, 2), max_num_batched_tokens=max(a.prompt_len, 1024) + 64,
                  block_tokens=64, max_model_len=max_len, yoco_prefill_keep_tokens=keep, **kw)
    if cuda:
        return LLM(ckpt, device="cuda", load_format="dummy", enforce_eager=True, **common)
    return LLM(ckpt, device="cpu", num_cache_blocks=(max(a.prompts, 2) + 1) * max_len // 64, **common)


def sync(cuda: bool) -> None:
    if cuda:
        import torch
        torch.cuda.synchronize()


def throughput(llm, a, cuda: bool) -> float:
    from deepinfer import SamplingParams
    one = SamplingParams(max_tokens=1, temperature=0)
    llm.generate(random_prompts(1, a.prompt_len, 99), one)             # warm-up
    prompts = random_prompts(a.prompts, a.prompt_len, 1)
    sync(cuda)
    t = time.perf_counter()
    llm.generate(prompts, one)
    sync(cuda)
    return a.prompts * a.prompt_len / (time.perf_counter() - t)


def forced_logits(llm, prompts, fed) -> list[np.ndarray]:
    from deepinfer import SamplingParams
    out = []
    for ids, f in zip(prompts, fed):
        o = llm.generate(ids, SamplingParams(max_tokens=len(f) + 1, temperature=0, ignore_eos=True),
                         forced_token_ids=[f], return_logits=True)[0]
        out.append(o.logits[:len(f) + 1])
    return out


def direct_drift(exact: list[np.ndarray], yoco: list[np.ndarray], lens: list[int]) -> str:
    rows = []
    for e, y, n in zip(exact, yoco, lens):
        d = np.abs(e - y).max(-1)
        top1 = int((e.argmax(-1) == y.argmax(-1)).sum())
        rows.append(f"P={n}: max|diff| prefill {d[0]:.3f} decode max {d[1:].max():.3f}, top1 {top1}/{len(d)}")
    return "; ".join(rows)


def fixture_candidate(ckpt: Path, a, keep: int, fixture: str) -> tuple[Path, list[np.ndarray], list[int]]:
    """The fixture's teacher-forced protocol through the engine; -> (candidate npz, logits, prompt lengths)."""
    from deepinfer import LLM
    expected = np.load(ckpt / "expected.npz")
    prompts = [list(map(int, p["ids"])) for p in json.load(open(ckpt / "prompts.json"))["prompts"]]
    fed = [expected[f"p{i}_fed_tokens"].astype(np.int64).tolist() for i in range(len(prompts))]
    llm = LLM(str(ckpt), device="cpu", block_tokens=8, max_num_batched_tokens=1024, max_num_seqs=2,
              num_cache_blocks=512, model_overrides={"emulate_index_k_alias": True}, yoco_prefill_keep_tokens=keep)
    logits = forced_logits(llm, prompts, fed)
    res = {}
    for i, (ids, f, lg) in enumerate(zip(prompts, fed, logits)):
        res[f"p{i}_prompt_ids"] = np.array(ids, dtype=np.int64)
        res[f"p{i}_prefill_logits"] = lg[0]
        res[f"p{i}_decode_logits"] = lg[1:len(f) + 1]
        res[f"p{i}_fed_tokens"] = np.array(f, dtype=np.int64)
    res["meta_json"] = np.array(json.dumps({"format": "dsv41-parity-candidate/1", "engine": "deepinfer",
                                            "mode": f"yoco{keep}" if keep else "exact"}))
    path = ckpt.parent / f"{fixture}-{keep}.npz"
    np.savez(path, **res)
    return path, logits, [len(p) for p in prompts]


def release(llm, cuda: bool) -> None:
    stop = getattr(llm.engine, "shutdown", None)
    if stop is not None:
        stop()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--keep", type=int, default=140)
    p.add_argument("--preset", default=None, help="default: tiny on cpu, full-width-ep8 on cuda")
    p.add_argument("--prompt-len", type=int, default=None, help="default: 512 on cpu, 8192 on cuda")
    p.add_argument("--prompts", type=int, default=None, help="default: 4")
    p.add_argument("--fixtures", nargs="*", default=["v41-tiny", "v41-tiny-bf16"], help="cpu drift (none: skip)")
    a = p.parse_args(argv)
    cuda = a.device == "cuda"
    a.preset = a.preset or ("full-width-ep8" if cuda else "tiny")
    a.prompt_len = a.prompt_len or (8192 if cuda else 512)
    a.prompts = a.prompts or 4
    from deepinfer.checkpoint.generator import hf_config, make_checkpoint, text_config
    from deepinfer.model.yoco import decoder_start
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        ckpt = tmp / a.preset
        if cuda:
            ckpt.mkdir()
            (ckpt / "config.json").write_text(json.dumps(hf_config(text_config(a.preset))))
        else:
            make_checkpoint(a.preset, 0, ckpt, progress=False)
        drift_prompts = random_prompts(2, a.prompt_len, 7)
        fed = [list(map(int, np.random.default_rng(8 + i).integers(1000, 120000, FED))) for i in range(2)]
        tps, logits = {}, {}
        for keep in (0, a.keep):      # one engine at a time (the second sizes its cache from free memory)
            llm = make_llm(str(ckpt), a, keep, cuda)
            m = llm.engine.model.args if hasattr(llm.engine, "model") else None
            tps[keep] = throughput(llm, a, cuda)
            logits[keep] = forced_logits(llm, drift_prompts, fed)
            release(llm, cuda)
            del llm
            gc.collect()
            if cuda:
                import torch
                torch.cuda.empty_cache()
        B = decoder_start(m) if m is not None else "?"
        n_layers = m.n_layers if m is not None else "?"
        print(f"YOCO prefill truncation, {a.preset} on {a.device} ({time.strftime('%Y-%m-%d')}): decoder = layers "
              f"{B}..{n_layers - 1 if m is not None else '?'} of {n_layers}, keep {a.keep}, "
              f"{a.prompts} x {a.prompt_len}-token prompts")
        print(f"  prefill tokens/s   exact {tps[0]:,.0f}   yoco {tps[a.keep]:,.0f}   ratio yoco/exact "
              f"{tps[a.keep] / tps[0]:.2f}x")
        print(f"  teacher-forced drift vs exact ({FED} fed tokens): "
              f"{direct_drift(logits[0], logits[a.keep], [len(x) for x in drift_prompts])}")
        if not cuda:
            for fx in a.fixtures:
                fck = build(fx, tmp)
                cands = {keep: fixture_candidate(fck, a, keep, fx) for keep in (0, a.keep)}
                for keep, (path, _, _) in cands.items():
                    print(f"  {fx:14s} {'exact' if not keep else f'yoco {keep}':9s} {check(fx, path)}")
                _, le, lens = cands[0]
                print(f"  {fx:14s} yoco vs exact: {direct_drift(le, cands[a.keep][1], lens)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
