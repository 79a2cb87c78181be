"""Multi-turn chat with and without prefix caching, side by side in one run.

    python perf/prefix_cache.py [--checkpoint DIR | --preset tiny] [--device cpu]
        [--system-tokens 2048] [--turns 8] [--conversations 32] [--user-tokens 64] [--output-tokens 32]
        [--small-cache-blocks N]      (more runs with prefix caching on a device cache too small for the
        [--host-cache-bytes B]         working set: without and with a host-memory tier of B bytes)

Every conversation starts with the same system prompt + tools (--system-tokens ids) and sends
--turns turns; turn k's prompt is turn k-1's prompt + its output + --user-tokens new ids (a chat
client resending its history), and turn k is sent the moment turn k-1 ends. All conversations start
together. Per mode it prints the prefill tokens computed, the prefix-cache hit rate, TTFT p50/p90
(request sent -> first token, measured at the engine loop) over all turns and over turns 2+ alone
(ttft2_*: the cached turns; the cold first turns are what the cache cannot help) and end-to-end
generated tokens/s; then the ratios off/on. Goal: turn-2+ prefill compute <= new tokens + 128 + one block per turn;
TTFT off/on >= 5x with 8k-token shared prefixes on the H200 (--preset small --device cuda
--system-tokens 8192). The figure perf/figures/prefix_cache.png shows TTFT and prefill per mode.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_throughput import default_checkpoint  # noqa: E402


def run_mode(ckpt: str, a, **engine_kw) -> dict:
    from deepinfer import SamplingParams
    from deepinfer.config import EngineArgs
    from deepinfer.engine import Engine
    from tqdm import tqdm

    eng = Engine(EngineArgs(checkpoint=ckpt, device=a.device, max_num_seqs=a.conversations,
                            max_num_batched_tokens=a.max_batched_tokens, block_tokens=a.block_tokens,
                            max_model_len=a.system_tokens + a.turns * (a.user_tokens + a.output_tokens) + 64,
                            **engine_kw))
    rng = np.random.default_rng(a.seed)
    vocab = eng.vocab_size
    system = rng.integers(3, vocab, a.system_tokens).tolist()
    user = rng.integers(3, vocab, (a.conversations, a.turns, a.user_tokens)).tolist()
    params = SamplingParams(max_tokens=a.output_tokens, temperature=0, ignore_eos=True)
    history = [list(system) for _ in range(a.conversations)]
    turn = [0] * a.conversations
    sent, first, cached, prompt_len, prev_end = {}, {}, {}, {}, {}
    outputs = {}

    def send(c: int) -> None:
        rid = f"c{c}-t{turn[c]}"
        prompt = history[c] + user[c][turn[c]]
        eng.add_request(rid, prompt, params)
        sent[rid], prompt_len[rid], outputs[rid] = time.perf_counter(), len(prompt), []
        history[c] = prompt

    t0 = time.perf_counter()
    for c in range(a.conversations):
        send(c)
    bar = tqdm(total=a.conversations * a.turns, desc=", ".join(f"{k}={v}" for k, v in engine_kw.items()) or "off",
               leave=False)
    while eng.has_unfinished_requests():
        for out in eng.step():
            rid = out.request_id
            c = int(rid[1:rid.index("-")])
            if out.new_token_ids and rid not in first:
                first[rid] = time.perf_counter()
            outputs[rid] += out.new_token_ids
            if out.finished:
                cached[rid] = out.num_cached_tokens
                prev_end[rid] = len(history[c]) + len(outputs[rid]) - 1   # a snapshot's position
                history[c] = history[c] + outputs[rid]
                turn[c] += 1
                bar.update()
                if turn[c] < a.turns:
                    send(c)
    wall = time.perf_counter() - t0
    bar.close()
    counters = eng.stats.snapshot()["counters"]
    gen = sum(len(v) for v in outputs.values())
    prefill = counters["computed_tokens_total"] - sum(max(len(v) - 1, 0) for v in outputs.values())
    ttft = np.array([first[r] - sent[r] for r in sent])
    later = [r for r in sent if not r.endswith("-t0")]
    # turns 2+ alone: the cold first turns (a third of the requests at 3 turns) are what the cache
    # cannot help, and they pull the all-turn p50 toward the off mode's
    ttft_later = np.array([first[r] - sent[r] for r in later]) if later else np.zeros(1)
    new_per_turn = a.user_tokens + a.output_tokens
    # turn 2+: tokens run for the prompt = uncached part + bounded replay (when no snapshot served it)
    replay = a.swa_replay_tokens if engine_kw.get("enable_prefix_caching") else 0
    later_prefill = [prompt_len[r] - cached[r] + (min(replay, cached[r]) if cached[r] % a.block_tokens == 0 and cached[r] else 0)
                     for r in later]
    eng.shutdown()
    return {"wall_s": wall, "generated": gen, "tok_s": gen / wall, "prefill_tokens": prefill,
            "hit_rate": counters["prefix_cache_hits_total"] / max(counters["prefix_cache_queries_total"], 1),
            "snapshot_hits": counters["prefix_cache_snapshot_hits_total"],
            "replayed": counters["prefix_cache_replayed_tokens_total"],
            "evictions": counters["prefix_cache_evictions_total"], "preemptions": counters["preemptions_total"],
            "host_hits": counters["prefix_cache_host_hits_total"],
            "ttft_p50": float(np.percentile(ttft, 50)), "ttft_p90": float(np.percentile(ttft, 90)),
            "ttft2_p50": float(np.percentile(ttft_later, 50)), "ttft2_p90": float(np.percentile(ttft_later, 90)),
            "later_prefill_mean": float(np.mean(later_prefill)) if later else 0.0,
            "later_prefill_max": int(max(later_prefill)) if later else 0,
            "later_goal": new_per_turn + 128 + a.block_tokens}


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(results)
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.8))
    x = np.arange(len(names))
    ax[0].bar(x - 0.2, [results[n]["ttft_p50"] for n in names], 0.4, label="p50")
    ax[0].bar(x + 0.2, [results[n]["ttft_p90"] for n in names], 0.4, label="p90")
    ax[0].set_xticks(x, names)
    ax[0].set_ylabel("TTFT (s)")
    ax[0].legend()
    ax[1].bar(x, [results[n]["prefill_tokens"] for n in names])
    ax[1].set_xticks(x, names)
    ax[1].set_ylabel("prefill tokens computed")
    fig.suptitle("multi-turn chat, prefix cache off vs on")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--device", default="cpu")
    p.add_argument("--system-tokens", type=int, default=2048)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--conversations", type=int, default=32)
    p.add_argument("--user-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--block-tokens", type=int, default=64)
    p.add_argument("--max-batched-tokens", type=int, default=2048)
    p.add_argument("--swa-replay-tokens", type=int, default=128)
    p.add_argument("--small-cache-blocks", type=int, default=0)
    p.add_argument("--host-cache-bytes", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--figure", default=str(Path(__file__).resolve().parent / "figures" / "prefix_cache.png"))
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = a.checkpoint or default_checkpoint(Path(tmp), a.preset)
        modes = {"off": {}, "on": {"enable_prefix_caching": True, "swa_replay_tokens": a.swa_replay_tokens}}
        if a.small_cache_blocks:
            modes["on, small"] = {**modes["on"], "num_cache_blocks": a.small_cache_blocks}
            if a.host_cache_bytes:
                modes["on, small+host"] = {**modes["on, small"], "host_cache_bytes": a.host_cache_bytes}
        results = {}
        for name, kw in modes.items():   # a line per mode as it ends: a run cut short still reports
            results[name] = r = run_mode(ckpt, a, **kw)
            print(f"[{name}] prefill {r['prefill_tokens']} tokens, hit rate {r['hit_rate']:.3f}, "
                  f"TTFT p50 {r['ttft_p50']:.3f} s p90 {r['ttft_p90']:.3f} s (turns 2+: p50 {r['ttft2_p50']:.3f} s "
                  f"p90 {r['ttft2_p90']:.3f} s), {r['tok_s']:.1f} tok/s", flush=True)
    print(f"{a.conversations} conversations x {a.turns} turns, system {a.system_tokens} tokens, +{a.user_tokens} "
          f"user / {a.output_tokens} output tokens a turn, block {a.block_tokens}, device {a.device}")
    keys = ["prefill_tokens", "hit_rate", "snapshot_hits", "replayed", "evictions", "host_hits", "preemptions",
            "ttft_p50", "ttft_p90", "ttft2_p50", "ttft2_p90", "tok_s", "wall_s", "later_prefill_mean", "later_prefill_max", "later_goal"]
    print(f"{'':22s}" + "".join(f"{n:>18s}" for n in results))
    for k in keys:
        print(f"{k:22s}" + "".join(f"{results[n][k]:18.4g}" for n in results))
    off, on = results["off"], results["on"]
    print(f"ratios off/on: prefill tokens {off['prefill_tokens'] / on['prefill_tokens']:.2f}x, "
          f"TTFT p50 {off['ttft_p50'] / on['ttft_p50']:.2f}x, TTFT p90 {off['ttft_p90'] / on['ttft_p90']:.2f}x, "
          f"turns 2+ TTFT p50 {off['ttft2_p50'] / on['ttft2_p50']:.2f}x p90 {off['ttft2_p90'] / on['ttft2_p90']:.2f}x; "
          f"tokens/s on/off {on['tok_s'] / off['tok_s']:.2f}x")
    print(f"goal turn 2+ prefill <= {on['later_goal']} tokens a turn: max {on['later_prefill_max']} "
          f"({'met' if on['later_prefill_max'] <= on['later_goal'] else 'NOT met'})")
    plot(results, Path(a.figure))
    print(f"figure: {a.figure}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
