"""Streaming load on the deepseek_v41_flash ensemble with perf_analyzer (tritonclient 2.51 wheel).

    .venv/bin/python perf/perf_analyzer_ensemble.py --checkpoint checkpoints/tiny [--concurrency 16]
    .venv/bin/python perf/perf_analyzer_ensemble.py --url 127.0.0.1:8001 ...   # a running server

Prints perf_analyzer's request/response throughput and first-response latency, then the ratio
asked for in the serving issue: streamed tokens/s through the ensemble divided by the engine's own
tokens/s (in-process AsyncEngine, same prompt, same concurrency, same max_tokens), measured in one run.
Input data: perf/inputs/chat_stream.json (a streamed Chat Completions request).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from deepinfer.ensemble import serve
from deepinfer.recipe import Preprocessor

HERE = Path(__file__).resolve().parent
INPUT = HERE / "inputs" / "chat_stream.json"


def request_body() -> dict:
    return json.loads(json.loads(INPUT.read_text())["data"][0]["request"][0])


def engine_tokens_per_s(checkpoint: str, concurrency: int, num_requests: int, engine_args: dict) -> float:
    """Closed loop, `concurrency` requests in flight, on the engine alone."""
    from deepinfer import AsyncEngine, EngineArgs, SamplingParams
    body = request_body()
    ids = Preprocessor(Path(checkpoint) / "tokenizer.json", engine_args["max_model_len"]).prepare(
        "chat.completions", json.dumps(body)).prompt_token_ids
    engine = AsyncEngine(EngineArgs.from_kwargs(checkpoint, **engine_args))
    tokens, lock, next_id = [0], threading.Lock(), iter(range(num_requests))
    params = SamplingParams(max_tokens=body["max_tokens"], temperature=1.0, stop_token_ids=[1])

    def worker():
        for i in next_id:
            for out in engine.stream(f"r{i}", ids, params):
                with lock:
                    tokens[0] += len(out.new_token_ids)

    for i in range(2):  # warm-up
        list(engine.stream(f"w{i}", ids, params))
    start = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    engine.shutdown()
    return tokens[0] / elapsed


def run_perf_analyzer(url: str, concurrency: int, num_requests: int, out_dir: Path) -> dict:
    export = out_dir / "profile.json"
    csv = out_dir / "perf.csv"
    cmd = [serve.perf_analyzer_bin(), "-m", "deepseek_v41_flash", "-u", url, "-i", "grpc", "--streaming", "--async",
           "--input-data", str(INPUT), "--concurrency-range", str(concurrency), "--measurement-mode",
           "count_windows", "--measurement-request-count", str(num_requests), "--stability-percentage", "999",
           "--max-trials", "3", "--profile-export-file", str(export), "-f", str(csv)]
    proc = subprocess.run(cmd, env=serve.perf_analyzer_env(), capture_output=True, text=True, timeout=900)
    print(proc.stdout[-3000:])
    if proc.returncode != 0:
        raise RuntimeError(f"perf_analyzer failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return {"stdout": proc.stdout, "export": json.loads(export.read_text(errors="replace"))}


def streamed_tokens_per_s(export: dict) -> tuple[float, int]:
    """Output tokens the ensemble streamed (the last num_output_tokens of each request) / wall time."""
    total, first, last = 0, None, None
    for exp in export["experiments"]:
        for req in exp["requests"]:
            outs = [o for o in req["response_outputs"] if "num_output_tokens" in o]
            if outs:
                total += max(int(_value(o["num_output_tokens"])) for o in outs)
            first = req["timestamp"] if first is None else min(first, req["timestamp"])
            end = max(req["response_timestamps"])
            last = end if last is None else max(last, end)
    return total / ((last - first) / 1e9), total


def first_response_latencies(export: dict) -> list[float]:
    """Seconds from each request to its first response (perf_analyzer's own figure for this
    decoupled ensemble is the whole request's latency)."""
    return sorted((min(r["response_timestamps"]) - r["timestamp"]) / 1e9
                  for exp in export["experiments"] for r in exp["requests"] if r["response_timestamps"])


def _value(v):
    return v[0] if isinstance(v, list) else v


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--checkpoint", default="checkpoints/tiny")
    ap.add_argument("--url", help="gRPC url of a running server (default: start one)")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--skip-engine", action="store_true", help="no in-process engine baseline")
    args = ap.parse_args(argv)
    engine_args = {"max_model_len": 4096, "max_num_seqs": max(args.concurrency, 16)}
    engine_tps = None if args.skip_engine else engine_tokens_per_s(
        args.checkpoint, args.concurrency, args.num_requests, engine_args)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        server = None
        if args.url is None:
            repo = serve.runtime_repository(tmp / "repo", args.checkpoint, engine_args["max_model_len"],
                                            {"max_num_seqs": engine_args["max_num_seqs"]})
            ports = serve.free_ports(3)
            server = serve.TritonServer(repo, *ports, log_path=tmp / "server.log").start(240)
            args.url = f"127.0.0.1:{ports[1]}"
        try:
            result = run_perf_analyzer(args.url, args.concurrency, args.num_requests, tmp)
        finally:
            if server is not None:
                server.stop()
    ens_tps, n_tokens = streamed_tokens_per_s(result["export"])
    ttft = first_response_latencies(result["export"])
    print(f"first-response latency (profile export): avg {sum(ttft) / len(ttft) * 1e3:.0f} ms, "
          f"p50 {ttft[len(ttft) // 2] * 1e3:.0f} ms, p90 {ttft[int(len(ttft) * 0.9)] * 1e3:.0f} ms")
    print(f"ensemble streamed tokens/s at concurrency {args.concurrency}: {ens_tps:.1f} ({n_tokens} tokens)")
    if engine_tps:
        print(f"engine tokens/s (in-process AsyncEngine, same load): {engine_tps:.1f}")
        print(f"ratio ensemble/engine: {ens_tps / engine_tps:.3f} (goal >= 0.9)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
