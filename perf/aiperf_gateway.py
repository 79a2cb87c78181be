"""AIPerf (NVIDIA's LLM benchmark, `pip install aiperf`) against the gateway's Chat Completions, streaming,
at a few concurrencies; prints its TTFT / ITL / throughput table and plots them.

    .venv/bin/python perf/aiperf_gateway.py --aiperf /path/to/venv/bin/aiperf            # own tiny server
    .venv/bin/python perf/aiperf_gateway.py --aiperf BIN --gateway http://127.0.0.1:9000 --checkpoint DIR

AIPerf pins its own dependencies (pydantic, transformers, ...), so it lives in a virtual environment
of its own; pass its binary with --aiperf. It tokenizes with the checkpoint's tokenizer.json (a
folder with tokenizer.json and a minimal tokenizer_config.json is written for it). The perf_analyzer
figures of the same ensemble come from perf/perf_analyzer_ensemble.py.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path


FIGURES = Path(__file__).resolve().parent / "figures"
MODEL = "deepseek-flash"


def tokenizer_dir(checkpoint: Path, dest: Path) -> Path:
    """tokenizer.json + a tokenizer_config.json naming the fast tokenizer class (what AutoTokenizer reads)."""
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "tokenizer.json").write_bytes((checkpoint / "tokenizer.json").read_bytes())
    (dest / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<｜begin▁of▁sentence｜>",
        "eos_token": "<｜end▁of▁sentence｜>", "model_max_length": 1048576}))
    return dest


def profile(aiperf: str, url: str, tokenizer: Path, concurrency: int, requests: int, isl: int, osl: int,
            out: Path) -> dict:
    cmd = [aiperf, "profile", "-m", MODEL, "--url", url, "--endpoint-type", "chat", "--streaming",
           "--tokenizer", str(tokenizer), "--concurrency", str(concurrency), "--request-count", str(requests),
           "--prompt-input-tokens-mean", str(isl), "--prompt-output-tokens-mean", str(osl),
           "--extra-inputs", json.dumps({"thinking": {"type": "disabled"}, "max_tokens": osl}),
           "--use-server-token-count", "--output-artifact-dir", str(out), "--no-auto-plot", "--random-seed", "0"]
    print(" ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)
    found = sorted(out.rglob("profile_export_aiperf.json"))
    return json.loads(found[-1].read_text()) if found else {}


def metric(result: dict, name: str, stat: str = "avg") -> float:
    m = result.get(name) or (result.get("records") or {}).get(name) or {}
    return float(m.get(stat, "nan")) if isinstance(m, dict) else float("nan")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--aiperf", required=True, help="the aiperf binary (its own virtual environment)")
    ap.add_argument("--gateway", help="a running gateway's URL (default: start a tiny server and a gateway)")
    ap.add_argument("--checkpoint", type=Path, help="the served checkpoint (its tokenizer.json), with --gateway")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--isl", type=int, default=128)
    ap.add_argument("--osl", type=int, default=32)
    ap.add_argument("--out", type=Path, default=FIGURES / "aiperf_gateway.png")
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="aiperf-"))
    if args.gateway:
        return run(args, args.gateway, args.checkpoint, tmp)
    from serving_stack import tiny_serving_stack
    with tiny_serving_stack("aiperf-", 4096, {"max_num_seqs": 64}) as st:
        return run(args, st.gateway_url, st.checkpoint, st.tmp)


def run(args, url: str, checkpoint: Path, tmp: Path) -> int:
    tok = tokenizer_dir(checkpoint, tmp / "tokenizer")
    rows = []
    for c in [int(x) for x in args.concurrency.split(",")]:
        result = profile(args.aiperf, url, tok, c, args.requests, args.isl, args.osl, tmp / f"c{c}")
        rows.append((c, metric(result, "time_to_first_token"), metric(result, "inter_token_latency"),
                     metric(result, "output_token_throughput"), metric(result, "request_throughput")))
    print(f"\n{'concurrency':>11} {'TTFT ms':>9} {'ITL ms':>8} {'out tok/s':>10} {'req/s':>7}")
    for c, ttft, itl, tps, rps in rows:
        print(f"{c:>11} {ttft:>9.1f} {itl:>8.1f} {tps:>10.1f} {rps:>7.2f}")
    plot(rows, args.out)
    return 0


def plot(rows, out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    cs = [r[0] for r in rows]
    a.plot(cs, [r[1] for r in rows], "o-", label="TTFT")
    a.plot(cs, [r[2] for r in rows], "o-", label="ITL")
    a.set_xlabel("concurrency")
    a.set_ylabel("ms")
    a.legend()
    b.plot(cs, [r[3] for r in rows], "o-")
    b.set_xlabel("concurrency")
    b.set_ylabel("output tokens/s")
    fig.suptitle("AIPerf through the gateway (Chat Completions, streaming)")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    print(f"figure: {out}")


if __name__ == "__main__":
    sys.exit(main())
