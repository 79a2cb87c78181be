"""Soak: many concurrent streams through the gateway for a bounded time, with random client
disconnects and random bad requests mixed in; then the integrity and leak figures.

    .venv/bin/python perf/soak.py                                    # 256 streams, 600 s, own tiny server
    .venv/bin/python perf/soak.py --streams 32 --duration 60         # a short run
    .venv/bin/python perf/soak.py --gateway URL --metrics URL [--stub-pid PID]   # a running deployment

Each worker loops until the deadline: a whole stream (one of the three APIs, random max_tokens), a
stream it leaves after a few chunks, or a bad request from the corpus (tests/serving/bad_input_corpus.py).
Checked per stream: Responses `sequence_number`s contiguous (gaps = lost, repeats = duplicated,
backwards = reordered); Chat: nothing after the finish chunk but usage, then [DONE]; Messages:
message_start first, message_stop last, block indices never going back; every finished stream's usage
equal to its max_tokens (or finish "stop"). After the warm-up (the first 20%) and after the run: the
engine's running/waiting/cache gauges and the gateway's in-flight gauge must return to 0, and the
engine stub's idle RSS at the two points gives its growth. Prints a table, writes perf/figures/soak.png (RSS and
in-flight over time) and a JSON summary.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.serving.bad_input_corpus import PATHS, generated  # noqa: E402

MODEL = "deepseek-flash"
FIGURES = Path(__file__).resolve().parent / "figures"


@dataclass
class Tally:
    counts: Counter = field(default_factory=Counter)
    problems: list = field(default_factory=list)

    def bad(self, kind: str, what: str) -> None:
        self.counts[kind] += 1
        if len(self.problems) < 20:
            self.problems.append(f"{kind}: {what}")


def body(api: str, max_tokens: int, rng: random.Random) -> dict:
    user = [{"role": "user", "content": f"Tell me about {rng.choice(['Paris', 'tea', 'crabs', 'rain'])}."}]
    if api == "chat.completions":
        return {"model": MODEL, "messages": user, "max_tokens": max_tokens, "stream": True,
                "stream_options": {"include_usage": True}, "thinking": {"type": rng.choice(["enabled", "disabled"])}}
    if api == "responses":
        return {"model": MODEL, "input": user[0]["content"], "max_output_tokens": max_tokens, "stream": True,
                "reasoning": {"effort": rng.choice(["none", "high"])}}
    return {"model": MODEL, "messages": user, "max_tokens": max_tokens, "stream": True,
            "thinking": {"type": rng.choice(["adaptive", "disabled"])}}


def check_stream(api: str, events: list[dict], done_marker: bool, max_tokens: int, tally: Tally) -> None:
    if api == "responses":
        seqs = [e["sequence_number"] for e in events]
        tally.counts["duplicated"] += len(seqs) - len(set(seqs))
        tally.counts["reordered"] += sum(1 for a, b in zip(seqs, seqs[1:]) if b < a)
        if seqs:
            tally.counts["lost"] += (max(seqs) - min(seqs) + 1) - len(set(seqs))
        last = events[-1] if events else {}
        usage = (last.get("response") or {}).get("usage") or {}
        if last.get("type") not in ("response.completed", "response.incomplete"):
            tally.bad("lost", f"responses stream ended with {last.get('type')}")
        elif usage.get("output_tokens") != max_tokens and last["response"]["status"] == "incomplete":
            tally.bad("usage", f"responses {usage.get('output_tokens')} != {max_tokens}")
    elif api == "chat.completions":
        finish = [i for i, e in enumerate(events) if e.get("choices") and e["choices"][0].get("finish_reason")]
        if len(finish) != 1 or not done_marker:
            tally.bad("lost", f"chat: {len(finish)} finish chunks, [DONE] {done_marker}")
            return
        after = events[finish[0] + 1:]
        if any(e.get("choices") for e in after):
            tally.bad("reordered", "chat: content after the finish chunk")
        usage = events[-1].get("usage") or {}
        if events[finish[0]]["choices"][0]["finish_reason"] == "length" and usage.get("completion_tokens") != max_tokens:
            tally.bad("usage", f"chat {usage.get('completion_tokens')} != {max_tokens}")
    else:
        types = [e["type"] for e in events if e["type"] != "ping"]
        if not types or types[0] != "message_start" or types[-1] != "message_stop":
            tally.bad("lost", f"messages: {types[:1]}..{types[-1:]}")
            return
        idx = [e["index"] for e in events if "index" in e]
        tally.counts["reordered"] += sum(1 for a, b in zip(idx, idx[1:]) if b < a)


async def one_stream(client: httpx.AsyncClient, url: str, api: str, rng: random.Random, tally: Tally,
                     leave_after: int | None) -> None:
    max_tokens = rng.randint(4, 48)
    events, done_marker = [], False
    async with client.stream("POST", url + PATHS[api], json=body(api, max_tokens, rng)) as r:
        if r.status_code != 200:
            tally.bad("refused", f"{api} {r.status_code}: {(await r.aread())[:120]!r}")
            return
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                done_marker = True
            elif line.startswith("data: "):
                events.append(json.loads(line[6:]))
                if leave_after is not None and len(events) >= leave_after:
                    tally.counts["disconnected"] += 1
                    return   # leaving the `async with` closes the connection mid-stream
    if any(e.get("type") == "error" or "error" in e for e in events):
        tally.bad("stream_error", json.dumps(events[-1])[:160])
        return
    check_stream(api, events, done_marker, max_tokens, tally)
    tally.counts["streams"] += 1


async def worker(i: int, url: str, deadline: float, bad_cases: list, tally: Tally) -> None:
    rng = random.Random(i)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300, connect=30)) as client:
        while time.monotonic() < deadline:
            roll = rng.random()
            try:
                if roll < 0.15:
                    case = rng.choice(bad_cases)
                    r = await client.request(case.method, url + case.path, content=case.body or None,
                                             headers={"content-type": "application/json", **case.headers})
                    tally.counts["bad_requests"] += 1
                    if r.status_code != case.status:
                        tally.bad("bad_request_status", f"{case.name}: {r.status_code} != {case.status}")
                else:
                    api = rng.choice(list(PATHS))
                    await one_stream(client, url, api, rng, tally, rng.randint(1, 6) if roll < 0.3 else None)
            except httpx.HTTPError as e:
                tally.bad("client_error", f"{type(e).__name__}: {e}")


def metric_sum(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


def rss_mb(pid: int | None) -> float:
    if pid is None:
        return float("nan")
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def sample(url: str, pid: int | None, deadline: float, series: list, t0: float) -> None:
    async with httpx.AsyncClient(timeout=10) as client:
        while time.monotonic() < deadline:
            gw = (await client.get(url + "/metrics")).text
            series.append((time.monotonic() - t0, rss_mb(pid), metric_sum(gw, "deepinfer_gateway_requests_in_flight")))
            await asyncio.sleep(2)


async def soak(url: str, metrics_url: str, pid: int | None, streams: int, duration: float) -> dict:
    """Warm-up (the first 20%), drain, idle RSS; the rest, drain, idle RSS: the growth compares two
    idle points, not two moments of a load whose RSS swings by 100s of MB with the batch."""
    tally, series = Tally(), []
    bad_cases = generated(60)
    t0 = time.monotonic()

    async def phase(seconds: float) -> dict:
        deadline = time.monotonic() + seconds
        await asyncio.gather(sample(url, pid, deadline, series, t0),
                             *(worker(i, url, deadline, bad_cases, tally) for i in range(streams)))
        return await drain(url, metrics_url)

    warm_drain = await phase(0.2 * duration)
    rss_warm = rss_mb(pid)
    drained = await phase(0.8 * duration)
    rss_end = rss_mb(pid)
    return {"workers": streams, "duration_s": duration, "wall_s": time.monotonic() - t0, **tally.counts,
            "problems": tally.problems, "gauges_back_to_0": drained, "warmup_gauges_back_to_0": warm_drain,
            "rss_warm_mb": rss_warm, "rss_end_mb": rss_end,
            "rss_growth_pct": 100 * (rss_end - rss_warm) / rss_warm, "series": series}


async def drain(url: str, metrics_url: str, timeout: float = 30) -> dict:
    """Seconds until every gauge read 0 (None: not within timeout)."""
    names = ["deepinfer_num_requests_running", "deepinfer_num_requests_waiting", "deepinfer_cache_usage"]
    t0 = time.monotonic()
    async with httpx.AsyncClient(timeout=10) as client:
        while time.monotonic() - t0 < timeout:
            engine = (await client.get(metrics_url)).text
            gw = (await client.get(url + "/metrics")).text
            values = {n: metric_sum(engine, n) for n in names}
            values["gateway_in_flight"] = metric_sum(gw, "deepinfer_gateway_requests_in_flight")
            if not any(values.values()):
                return {"after_s": round(time.monotonic() - t0, 1), **values}
            await asyncio.sleep(0.5)
    return {"after_s": None, **values}


def report(result: dict, out_png: Path) -> None:
    keys = ["streams", "disconnected", "bad_requests", "lost", "duplicated", "reordered", "usage", "stream_error",
            "refused", "bad_request_status", "client_error"]
    print(f"\nsoak: {result['workers']} workers for {result['duration_s']:.0f} s (wall {result['wall_s']:.0f} s)")
    for k in keys[:3]:
        print(f"  {k:22s} {result.get(k, 0)}")
    for k in keys[3:]:
        print(f"  {k:22s} {result.get(k, 0)}   (want 0)")
    print(f"  gauges back to 0       {result['gauges_back_to_0']}")
    print(f"  stub RSS at idle       {result['rss_warm_mb']:.0f} MB after warm-up -> {result['rss_end_mb']:.0f} MB "
          f"at the end ({result['rss_growth_pct']:+.1f} %)")
    for p in result["problems"]:
        print("  PROBLEM", p)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    t = [s[0] for s in result["series"]]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(t, [s[1] for s in result["series"]], label="engine stub RSS (MB)")
    ax.set_xlabel("seconds")
    ax.set_ylabel("MB")
    ax2 = ax.twinx()
    ax2.plot(t, [s[2] for s in result["series"]], color="tab:orange", label="gateway requests in flight")
    ax2.set_ylabel("in flight")
    fig.legend(loc="lower right")
    ax.set_title(f"soak: {result['workers']} workers, {result['duration_s']:.0f} s")
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=100)
    print(f"figure: {out_png}")


def failed(result: dict) -> bool:
    zero = ["lost", "duplicated", "reordered", "usage", "stream_error", "refused", "bad_request_status"]
    return any(result.get(k, 0) for k in zero) or result["gauges_back_to_0"]["after_s"] is None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--duration", type=float, default=600.0)
    ap.add_argument("--gateway", help="a running gateway's URL (default: start a tiny server and a gateway)")
    ap.add_argument("--metrics", help="the running Triton's metrics URL (with --gateway)")
    ap.add_argument("--stub-pid", type=int, help="the engine stub's pid (with --gateway), for RSS")
    ap.add_argument("--max-num-seqs", type=int, default=256, help="engine batch cap of the own server")
    ap.add_argument("--out", type=Path, default=FIGURES / "soak.png")
    args = ap.parse_args(argv)
    if args.gateway:
        result = asyncio.run(soak(args.gateway, args.metrics, args.stub_pid, args.streams, args.duration))
    else:
        result = _with_servers(args)
    report(result, args.out)
    args.out.with_suffix(".json").write_text(json.dumps({k: v for k, v in result.items() if k != "series"}, indent=1))
    return 1 if failed(result) else 0


def _with_servers(args) -> dict:
    from serving_stack import tiny_serving_stack
    with tiny_serving_stack("soak-", 2048, {"max_num_seqs": args.max_num_seqs}) as st:
        pid = next(p for k, p in st.server.stub_pids().items() if k.startswith("deepinfer:"))
        return asyncio.run(soak(st.gateway_url, st.metrics_url, pid, args.streams, args.duration))


if __name__ == "__main__":
    sys.exit(main())
