"""The full bad-input corpus against a real server: >= 500 cases, each answered with the official
status and the API's error body, the server healthy after each, a stream beside it untouched.

    .venv/bin/python perf/bad_inputs.py                         # starts tritonserver + gateway (tiny model)
    .venv/bin/python perf/bad_inputs.py --gateway http://127.0.0.1:9000 --triton http://127.0.0.1:8000

Prints the counts by API and expected status, every wrong answer, the answer-time percentiles and the
wall time; exits 1 on any wrong answer or an unhealthy server. The corpus itself (what is generated,
what is hand-written) is tests/serving/bad_input_corpus.py.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # the corpus lives in tests/
from tests.serving.bad_input_corpus import corpus, healthy, run_case  # noqa: E402


def run(urls: dict, n_generated: int, max_request_bytes: int) -> int:
    cases = corpus(n_generated, max_request_bytes)
    wrong, seconds, unhealthy = [], [], []
    t0 = time.perf_counter()
    with httpx.Client(timeout=120) as client:
        for case in tqdm(cases, desc="bad inputs"):
            t = time.perf_counter()
            problem = run_case(client, urls, case)
            seconds.append(time.perf_counter() - t)
            if problem:
                wrong.append(f"{case.name}: {problem}")
            if not healthy(client, urls):
                unhealthy.append(case.name)
                break
    wall = time.perf_counter() - t0
    by = Counter((c.api, c.status) for c in cases)
    print(f"\n{len(cases)} cases in {wall:.1f} s")
    for (api, status), n in sorted(by.items()):
        print(f"  {api:18s} expected {status}: {n}")
    seconds.sort()
    pct = {p: seconds[min(len(seconds) - 1, int(p / 100 * len(seconds)))] for p in (50, 90, 99, 100)}
    print("answer time: " + ", ".join(f"p{p} {v * 1000:.0f} ms" for p, v in pct.items()))
    print(f"right: {len(cases) - len(wrong)}/{len(cases)}; unhealthy after: {unhealthy or 'none'}")
    for w in wrong:
        print("  WRONG", w)
    return 1 if wrong or unhealthy else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gateway", help="a running gateway's URL (default: start one)")
    ap.add_argument("--triton", help="a running Triton's HTTP URL (with --gateway)")
    ap.add_argument("--generated", type=int, default=450, help="hypothesis-generated cases")
    ap.add_argument("--max-request-bytes", type=int, default=300_000, help="the gateway's limit (413 above it)")
    args = ap.parse_args(argv)
    if args.gateway:
        return run({"gateway": args.gateway, "text": args.triton}, args.generated, args.max_request_bytes)
    return _with_servers(args)


def _with_servers(args) -> int:
    from serving_stack import tiny_serving_stack
    with tiny_serving_stack("bad-inputs-", 2048, {"max_num_seqs": 40},
                            ("--max-request-bytes", str(args.max_request_bytes))) as st:
        return run({"gateway": st.gateway_url, "text": st.http_url}, args.generated, args.max_request_bytes)


if __name__ == "__main__":
    sys.exit(main())
