"""DSpark verification policies side by side, with replayed acceptance: verify-all, the static
threshold and the confidence scheduler against no speculation, at several batch sizes, in one run.

    python perf/spec_decode.py [--checkpoint DIR | --preset tiny|small|full-width-ep8] [--device cpu|cuda]
                               [--batches 1 16 64] [--prompt-len 64] [--output-len 64] [--quick]
                               [--accepted-length 3.5] [--threshold 0.5] [--floor 0.98] [--load-format dummy] [--variants]
                               [--enforce-eager] [--async-overlap] [--json $OUT/spec_decode.json]
                               [--plot perf/figures/spec_decode_cpu.png]

H200 (one GPU; the small preset and one GPU's EP8 share of the full width, random weights made on
the device: --load-format dummy needs only config.json, written here from the preset):
    timeout 280 python perf/spec_decode.py --preset small --device cuda --load-format dummy --quick --budget-s 200
    timeout 280 python perf/spec_decode.py --preset full-width-ep8 --device cuda --load-format dummy --quick --budget-s 200
--quick: prompt 32, output 32 tokens per request. Warm-ups of 16 tokens at every batch size. --budget-s: no policy
starts after that many seconds (the JSON is rewritten after every policy, the per-run lines print as
they finish, so a run cut short still reports what it measured). A progress line on stderr
counts the output tokens of each (policy, batch) run. Decode and DSpark verify steps replay CUDA
graphs (captured at each engine's start) unless --enforce-eager; the drafting pass is eager.

Random weights accept nothing, so every speculative engine runs in the replay mode
(EngineArgs.spec_replay_accepted_length, deepinfer/spec/replay.py): each proposal's confidences and
acceptance outcome are drawn from a stated distribution (calibrated Beta confidences, mean accepted
length --accepted-length of 5 under verify-all: 3.5 is V4.1-Flash DSpark-5 with thinking on),
while the engine runs every verify step for real (the verified lengths the policy picks, rollback,
proposals). --concentration sets how sharp the confidences are (kappa, 2 by default), --regime-tokens S
makes them persist over regimes of S positions (0: independent per proposal); the goal lines print
the best accepted length any policy deciding from the confidences could keep at the same cut.
The scheduler's step-time model is profiled at engine start on this device.
Engines are built one at a time (one set of caches in memory); the ratios are taken at the end.
The policies run with the engine's defaults: on CUDA that is async scheduling with overlapped verify
steps (before 2026-12-02, late, the synchronous engine: the README's first full-width table).
--async-overlap replaces the policies by verify-all three ways: synchronous, async scheduling with
every verify step resolved before the next schedule, and async with verify steps that overlap
(spec/overlap.py: the next one launched before the counts reach the host), and prints their ratios,
plus the confidence scheduler with overlap ("sched overlap": B from the older confidences on the
host, split by the newest on the device, spec/overlap_verify.py) against overlapped verify-all.
Tiny preset, CPU, 2026-12-02, --async-overlap --quick --batches 16 64 (replayed acceptance 3.5): the
overlapped scheduler verifies 1.57 / 1.44 drafts per accepted draft against 1.92-2.11 for overlapped
verify-all (0.74x / 0.75x; 0.59x / 0.63x the drafts per request-step) at 0.86x / 0.89x its accepted
length, at 0.95x / 0.88x its tok/s (a CPU step hardly shrinks with fewer drafts at these sizes).
Tiny preset, CPU (2 shared cores, OMP_NUM_THREADS=1), 2026-12-02, --quick --batches 16 64:
overlap / sync verify-all 0.96x (batch 16) and 0.83x (batch 64) tok/s per GPU, 0.95x / 0.93x async
with verify steps resolved first; 14 of 37 speculative steps overlapped. On a CPU there is nothing
to hide (torch CPU ops are synchronous), so these are the overlap path's own costs (the padded
static step run eagerly, all of a step's rows absorbed); the H200 run is the one that counts.

Columns, per batch, in the decode phase (speculation speeds decoding; the prefill and first token are the
same for every policy): tok/s per user (mean over requests of output tokens after the first / the time
from their first token to their last), tok/s per GPU (output tokens after each request's first / the
time from the batch's last first token to its end / GPUs), "e2e x off" (all output tokens / wall time,
prefill included, against no speculation), the ratio of each to no speculation,
verified drafts per accepted draft, accepted length (output tokens per request-step that sampled,
steps that verified no draft included) and drafts verified per request-step and accepted length as
fractions of verify-all's. "steady/GPU": tok/s while the whole batch decodes (before its first request
finishes: what a server holding that many requests sees; the drained "tok/s/GPU" also counts the ragged
end, where requests stuck in slow regimes run at a smaller batch). After the table, the steady figures
projected to the 40-layer backbone (project_layers): a checkpoint of 7 layers makes the drafting pass,
which does not grow with the backbone, look ~6x dearer than beside the real model. The issue's goal: the
scheduler verifies >= 25% fewer drafts than verify-all at >= 0.98 of its accepted length, and
beats the static threshold in tok/s at batch 64.

Tiny preset, CPU (2 shared cores), 2026-12-02, prompt 16, output 64, --variants (figure
perf/figures/spec_decode_cpu.png). Step times hardly grow with drafts at batch 1-4 (60.8 -> 66.4 ms
at n=1), so the scheduler verifies nearly everything there; at batch 16 (96 -> 200 ms) it cuts 39%
of the drafts. CPU timings move by 10-20% between runs on this shared machine:
    batch  policy            tok/s/user  x off  verif/acc  acc len  verif x all  acc len x all
    1      verify-all            65.3    2.34     1.74      3.56       1.00          1.00
    1      threshold 0.5         51.5    1.84     1.23      3.20       0.61          0.90
    1      scheduler             62.2    2.23     1.65      3.56       0.95          1.00
    16     verify-all            16.8    0.84     1.94      3.31       1.00          1.00
    16     threshold 0.5         19.0    0.95     1.34      2.66       0.50          0.80
    16     scheduler             15.8    0.79     1.52      2.81       0.61          0.85
    16     sched early-stop      20.7    1.03     1.71      2.98       0.76          0.90
"""

from __future__ import annotations

import argparse
import random
import sys
import statistics
import tempfile
import time
from pathlib import Path

T_START = time.perf_counter()
sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchutil import release_engine_memory  # noqa: E402
from engine_throughput import default_checkpoint  # noqa: E402


class Progress:
    """One stderr line per run: output tokens so far of the total (no dependency; a pipe gets the
    final count only)."""

    def __init__(self, label: str, total: int) -> None:
        self.label, self.total, self.done, self.t0 = label, total, 0, time.perf_counter()
        self.tty = sys.stderr.isatty()
        self._last = 0.0

    def update(self, n: int) -> None:
        self.done += n
        now = time.perf_counter()
        if self.tty and (now - self._last > 0.2 or self.done >= self.total):
            self._last = now
            width = 30
            fill = int(width * self.done / max(self.total, 1))
            print(f"\r  {self.label:<28} [{'#' * fill}{'.' * (width - fill)}] {self.done}/{self.total} tok "
                  f"{now - self.t0:6.1f} s", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        end = "\n" if self.tty else ""
        print(f"{end}  {self.label:<28} {self.done}/{self.total} tok in {time.perf_counter() - self.t0:.1f} s",
              file=sys.stderr, flush=True)


def run_batch(engine, batch: int, prompt_len: int, output_len: int, vocab: int, seed: int = 0,
              label: str | None = None, temperature: float = 0.0) -> dict:
    """All requests at once (ignore_eos; greedy, or at `temperature` with top_p 0.95 and a seed each);
    per-request finish times from the step loop."""
    from deepinfer import SamplingParams
    rng = random.Random(seed)
    before = engine.stats.snapshot()["counters"]
    t0 = time.perf_counter()
    for i in range(batch):
        params = SamplingParams(max_tokens=output_len, temperature=temperature, ignore_eos=True,
                                **(dict(top_p=0.95, seed=1000 * seed + i) if temperature > 0 else {}))
        engine.add_request(f"b{batch}-{seed}-{i}", [rng.randrange(3, vocab - 300) for _ in range(prompt_len)], params)
    done, first, tokens, req_steps = {}, {}, {}, 0
    timeline = []                 # (seconds, output tokens so far, all first tokens out, any request done)
    bar = Progress(label, batch * output_len) if label else None
    while engine.has_unfinished_requests():
        outs = engine.step()
        for out in outs:
            tokens[out.request_id] = tokens.get(out.request_id, 0) + len(out.new_token_ids)
            if out.new_token_ids and out.request_id not in first:
                first[out.request_id] = time.perf_counter() - t0
            req_steps += bool(out.new_token_ids)
            if bar is not None:
                bar.update(len(out.new_token_ids))
            if out.finished:
                done[out.request_id] = time.perf_counter() - t0
        timeline.append((time.perf_counter() - t0, sum(tokens.values()), len(first) == batch, bool(done)))
    wall = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    c = engine.stats.snapshot()["counters"]
    d = {k: c[k] - before[k] for k in c}
    total = sum(tokens.values())
    assert total == batch * output_len, (total, batch * output_len)
    verified, acc = d["spec_draft_tokens_verified_total"], d["spec_draft_tokens_accepted_total"]
    # per request-step that sampled (prefill's first token included, the same for every policy): tokens
    # gained and drafts verified; a step whose policy verified no draft counts too
    # decode phase (the prefill and first token are the same for every policy and, at 64 output
    # tokens, a large share of the end-to-end time): tokens after the first / time after the first,
    # per request; and for the batch, from the last first token to the end
    last_first = max(first.values())
    return {"per_user": sum((tokens[r] - 1) / (done[r] - first[r]) for r in done) / len(done),
            "total": (total - len(done)) / (wall - last_first), **steady_rates(timeline),
            "per_user_e2e": sum(tokens[r] / done[r] for r in done) / len(done), "total_e2e": total / wall,
            "verified": verified, "accepted": acc, "steps": d["steps_total"],
            "paused_steps": d.get("spec_paused_steps_total", 0),
            "mean_acc_len": total / req_steps, "verified_per_step": verified / req_steps,
            "tokens": total, "req_steps": req_steps}


def steady_window(timeline: list[tuple]) -> tuple[float, float, int]:
    """(output tokens, seconds, steps) while the whole batch decodes: from the step after which every
    request has its first token to the step in which the first one finishes. What a server holding this
    many requests sees with continuous batching; "total" also counts the drain at the end, where the
    requests left in slow acceptance regimes run at a smaller batch (a fixed batch with variable
    acceptance ends ragged; without speculation every request ends in the same step). A run with no
    such window (one request, one step): the whole run."""
    start = next((i for i, e in enumerate(timeline) if e[2]), None)
    end = next((i for i, e in enumerate(timeline) if e[3]), None)
    if start is None or end is None or end <= start:
        return timeline[-1][1], timeline[-1][0], len(timeline)
    return timeline[end][1] - timeline[start][1], timeline[end][0] - timeline[start][0], end - start


def steady_rates(timeline: list[tuple]) -> dict:
    tokens, seconds, steps = steady_window(timeline)
    return {"steady": tokens / seconds if seconds > 0 else float("nan"),
            "steady_step_s": seconds / steps, "steady_tokens_per_step": tokens / steps}


def project_layers(step_s: float, draft_s: float, layers: int, target_layers: int) -> float:
    """A step's seconds at `target_layers` layers from one measured at `layers`: the drafting pass and
    the speculative bookkeeping (draft_s: the step-time model's zero-draft step minus the plain decode
    step at the same batch) do not grow with the backbone; the rest is taken as proportional to the
    layer count (the head and sampling are counted with it, so this overstates the deep step a
    little, as bench_model_prefill's 40-layer estimate does)."""
    draft_s = min(max(draft_s, 0.0), step_s)
    return draft_s + (step_s - draft_s) * target_layers / layers


RATES = ("per_user", "total", "steady", "steady_step_s", "steady_tokens_per_step", "per_user_e2e", "total_e2e")
FULL_LAYERS = 40                  # V4.1-Flash's backbone: the projection's target (project_layers)
COUNTS = ("verified", "accepted", "steps", "tokens", "req_steps", "paused_steps")


def combine_repeats(runs: list[dict]) -> dict:
    """Several timed runs of one (policy, batch) -> one: the median of each rate (a run's wall time moves
    by tens of percent on a short GPU run: H200, 2026-12-03, verify-all at batch 1 299 and 478 tok/s in two
    calls with the same draws), counts summed and the per-step ratios taken over the sums."""
    out = {k: statistics.median(r[k] for r in runs) for k in RATES}
    out.update({k: sum(r[k] for r in runs) for k in COUNTS})
    out["mean_acc_len"] = out["tokens"] / out["req_steps"]
    out["verified_per_step"] = out["verified"] / out["req_steps"]
    out["runs"] = [{k: r[k] for k in RATES} for r in runs]
    return out


def config_only_checkpoint(tmp: Path, preset: str) -> str:
    """A folder with the preset's config.json (text only) and tokenizer.json: what load_format="dummy"
    reads (the weights are drawn on the device), so no shard is written for the large presets."""
    import json
    from deepinfer.checkpoint.generator import PRESETS, hf_config, text_config
    from deepinfer.checkpoint.tokenizer import write_tokenizer
    if preset not in PRESETS:
        raise SystemExit(f"unknown preset {preset!r}: one of {', '.join(PRESETS)}")
    out = tmp / f"{preset}-dummy"
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf_config(text_config(preset)), indent=2, ensure_ascii=False))
    write_tokenizer(out / "tokenizer.json")
    return str(out)


def configs(a) -> dict[str, dict]:
    spec = dict(speculative="dspark", spec_replay_accepted_length=a.accepted_length, spec_acceptance=a.acceptance,
                spec_replay_concentration=a.concentration, spec_replay_regime_tokens=a.regime_tokens)
    if a.async_overlap:     # verify-all synchronous, async with every verify step resolved first, overlapped
        return {"off": {}, "verify-all": {**spec, "spec_policy": "all", "async_scheduling": False},
                "all async": {**spec, "spec_policy": "all", "async_scheduling": True, "spec_async_overlap": False},
                "all overlap": {**spec, "spec_policy": "all", "async_scheduling": True},
                "sched overlap": {**spec, "spec_policy": "scheduler", "async_scheduling": True}}
    return {"off": {},
            "verify-all": {**spec, "spec_policy": "all"},
            "scheduler": {**spec, "spec_policy": "scheduler"},
            f"threshold {a.threshold}": {**spec, "spec_policy": "threshold", "spec_confidence_threshold": a.threshold},
            **({f"sched floor {a.floor}": {**spec, "spec_policy": "scheduler", "spec_acceptance_floor": a.floor}}
               if a.floor else {}),
            **({"sched newest": {**spec, "spec_policy": "scheduler", "spec_budget_confidences": "newest"},
                "sched early-stop": {**spec, "spec_policy": "scheduler", "spec_early_stop": True},
                "sched face value": {**spec, "spec_policy": "scheduler", "spec_calibrate_older": False},
                # padded verify graphs (one cap L for the batch): what the packed keys replaced
                "sched padded": {**spec, "spec_policy": "scheduler", "spec_packed_verify": False},
                # drafting paused where a plain step is faster (spec/pause.py)
                "sched pause": {**spec, "spec_policy": "scheduler", "spec_pause": True},
                # the profiled step times corrected by the served verify steps (spec/step_time_online.py)
                "sched online": {**spec, "spec_policy": "scheduler", "spec_step_time_online": True}}
               if a.variants else {})}


def measure_all(ckpt: str, a, meta: dict) -> dict:
    """Every policy's runs; meta gets the scheduler's zero-draft step seconds per batch (the projection)."""
    from deepinfer import LLM
    base = dict(device=a.device, max_num_seqs=max(a.batches), max_num_batched_tokens=max(2048, 6 * max(a.batches)),
                load_format=a.load_format, seed=0, enforce_eager=a.enforce_eager, dense_weights=a.dense_weights,
                dummy_routing=a.routing if a.load_format == "dummy" else "model")
    if a.num_cache_blocks:
        base["num_cache_blocks"] = a.num_cache_blocks
    elif a.device.startswith("cuda"):
        # caches sized to the workload, not to 0.85 of the free memory: on the H200 (2026-12-02) the
        # second engine ran out of memory building itself (the first's was not all returned)
        per_request = -(-(a.prompt_len + a.output_len + 16) // 64) + 1
        base["num_cache_blocks"] = max(a.batches) * per_request + 64
    if a.prefix_caching:        # every engine with the prefix cache on (distinct prompts: no hits, the bookkeeping)
        base["enable_prefix_caching"] = True
    res = {}
    chosen = configs(a)
    if a.policies:
        unknown = set(a.policies) - set(chosen)
        if unknown:
            raise SystemExit(f"unknown policies {sorted(unknown)}: of {', '.join(chosen)}")
        # the table's ratios are to these two
        chosen = {k: v for k, v in chosen.items() if k in {"off", "verify-all", *a.policies}}
    for name, extra in chosen.items():
        t0 = time.perf_counter()
        llm = LLM(ckpt, **base, **extra)
        eng = llm.engine
        vocab = eng.vocab_size
        print(f"[{name}] engine up in {time.perf_counter() - t0:.1f} s (step-time profile included)", flush=True)
        # warm-up at every batch size (first-touch allocations, kernel builds and autotuning per shape):
        # without it the first policy to reach a shape pays for it and every ratio to it is off
        # 16 tokens: several verify steps per request, so the overlapped and static-graph forms of each
        # batch size are built here (4 left the first overlapped steps at batch 64 to the timed run:
        # H200, 2026-12-02, 1.7 s instead of 0.4 s)
        for b in a.batches:
            run_batch(eng, b, a.prompt_len, min(a.output_len, 16), vocab, seed=99 + b,
                      temperature=a.temperature)
        res[name] = {}
        for b in a.batches:
            r = res[name][b] = combine_repeats([
                run_batch(eng, b, a.prompt_len, a.output_len, vocab, seed=rep, label=f"{name} batch {b}",
                          temperature=a.temperature) for rep in range(a.repeats)])
            print(f"[{name}] batch {b}: {r['per_user']:.1f} tok/s/user, {r['total']:.1f} tok/s, {r['steps']} steps, "
                  f"verified {r['verified']}, accepted {r['accepted']}, acc len {r['mean_acc_len']:.2f}", flush=True)
        if a.json:         # after every policy: a run cut short by `timeout` still leaves its data
            save_json(a, res)
        report_engine(name, eng, meta, a)
        print(f"[{name}] done in {time.perf_counter() - t0:.1f} s", flush=True)
        eng.shutdown()
        del llm, eng
        print(f"[{name}] after teardown: {release_engine_memory():.1f} GiB still allocated", flush=True)
        if a.budget_s and time.perf_counter() - T_START > a.budget_s:
            left = [n for n in configs(a) if n not in res]
            if left:
                print(f"--budget-s {a.budget_s:.0f} spent: not run {left}", flush=True)
            break
    return res


def report_engine(name: str, eng, meta: dict, a) -> None:
    """The engine's overlap, graph and step-time-model counters. A function of its own so nothing here
    outlives the engine: a CUDA-graph handle left in a local kept a 40-layer engine's memory alive into
    the next policy's build (OOM on the H200, 2026-12-03)."""
    if eng.async_scheduling and eng.args.speculative:
        print(f"[{name}] verify steps overlapped {eng.num_verify_steps_overlapped}, steps resolved before "
              f"the next schedule {eng.num_resolved_before_schedule}", flush=True)
    graphs = getattr(eng.runner, "graphs", None)
    if graphs is not None:
        drafts = getattr(getattr(eng.runner, "proposer", None), "graphs", None)
        print(f"[{name}] CUDA graphs: {graphs.num_replays} replays, {graphs.num_verify_steps} verify steps "
              f"of {graphs.num_steps} through the static form"
              + (f", {drafts.num_steps} drafting passes" if drafts is not None else ""), flush=True)
    model = getattr(eng, "step_time_model", None)
    if model is not None:
        meta.setdefault("zero_draft_step_s", {b: model.time(b, 0) for b in a.batches})
        print(f"[{name}] step-time model (s): batch sizes {model.batch_sizes} x drafts/request "
              f"{model.drafts_per_seq}: " + "; ".join(
                  f"n={n}: " + " ".join(f"{t * 1e3:.1f}" for t in row) + " ms"
                  for n, row in zip(model.batch_sizes, model.seconds)), flush=True)


def save_json(a, res: dict) -> None:
    import json
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps({"args": vars(a), "results": res}, indent=1))


def report(res: dict, batches: list[int], gpus: int, a=None) -> None:
    names = list(res)
    if "off" not in res or "verify-all" not in res:
        print("no table: the run did not reach both no speculation and verify-all")
        return
    print(f"\n{'batch':>5} {'policy':>16} {'tok/s/user':>10} {'x off':>6} {'tok/s/GPU':>10} {'x off':>6} "
          f"{'steady/GPU':>10} {'x off':>6} {'e2e x off':>9} {'verif/acc':>9} {'x all':>6} {'acc len':>7} {'verif x all':>11} {'acc len x all':>13}")
    for b in batches:
        off, va = res["off"][b], res["verify-all"][b]
        for n in names:
            r = res[n][b]
            vpa = r["verified"] / r["accepted"] if r["accepted"] else float("nan")
            vpa_x = vpa / verified_per_accepted(va) if n != "off" else float("nan")
            vx = r["verified_per_step"] / va["verified_per_step"] if n != "off" and va["verified"] else float("nan")
            lx = r["mean_acc_len"] / va["mean_acc_len"] if n != "off" else float("nan")
            print(f"{b:>5} {n:>16} {r['per_user']:>10.1f} {r['per_user'] / off['per_user']:>6.2f} "
                  f"{r['total'] / gpus:>10.1f} {r['total'] / off['total']:>6.2f} "
                  f"{r['steady'] / gpus:>10.1f} {r['steady'] / off['steady']:>6.2f} "
                  f"{r.get('total_e2e', r['total']) / off.get('total_e2e', off['total']):>9.2f} {vpa:>9.2f} {vpa_x:>6.2f} "
                  f"{r['mean_acc_len']:>7.2f} {vx:>11.2f} {lx:>13.2f}")
    if "all overlap" in res:
        for b in batches:
            va, o = res["verify-all"][b], res["all overlap"][b]
            line = (f"async overlap @ batch {b}: tok/s per GPU {o['total'] / va['total']:.2f}x synchronous "
                    f"verify-all, per user {o['per_user'] / va['per_user']:.2f}x")
            if "all async" in res:
                line += f"; {o['total'] / res['all async'][b]['total']:.2f}x async with verify steps resolved first"
            print(line)
    if "all overlap" in res and "sched overlap" in res:
        for b in batches:
            o, s = res["all overlap"][b], res["sched overlap"][b]
            vs, vo = verified_per_accepted(s), verified_per_accepted(o)
            print(f"overlapped scheduler @ batch {b}: verified per accepted {vs:.2f} vs {vo:.2f} overlapped "
                  f"verify-all ({vs / vo:.2f}x), "
                  f"drafts verified per step {s['verified_per_step'] / o['verified_per_step']:.2f}x, accepted length "
                  f"{s['mean_acc_len'] / o['mean_acc_len']:.2f}x, tok/s per GPU {s['total'] / o['total']:.2f}x")
    if "scheduler" in res and "sched padded" in res:
        for b in batches:
            s, p = res["scheduler"][b], res["sched padded"][b]
            print(f"packed verify graphs @ batch {b}: scheduler tok/s per GPU {s['total'] / p['total']:.2f}x the padded "
                  f"graphs', drafts verified per step {s['verified_per_step']:.1f} vs {p['verified_per_step']:.1f}, "
                  f"accepted length {s['mean_acc_len']:.2f} vs {p['mean_acc_len']:.2f}")
    th = [n for n in names if n.startswith("threshold")]
    if "scheduler" not in res or not th:
        return
    th = th[0]
    bound = oracle_bounds(a) if a is not None else None
    for name, b in ((n, b) for n in ["scheduler"] + [n for n in names if n.startswith("sched floor")]
                    for b in batches):
        s, va, t = res[name][b], res["verify-all"][b], res[th][b]
        fewer = 1 - s["verified_per_step"] / va["verified_per_step"] if va["verified"] else float("nan")
        print(f"goal @ batch {b}: {name} verifies {fewer:.0%} fewer drafts than verify-all "
              f"(goal >= 25%) at {s['mean_acc_len'] / va['mean_acc_len']:.2f} of its accepted length (goal >= 0.98); "
              f"verified per accepted {verified_per_accepted(s) / verified_per_accepted(va):.2f}x verify-all's; "
              f"tok/s vs threshold {s['total'] / t['total']:.2f}x (goal > 1 at batch 64); vs verify-all "
              f"{s['total'] / va['total']:.2f}x per GPU, {s['per_user'] / va['per_user']:.2f}x per user; "
              f"steady (whole batch decoding): {s['steady'] / va['steady']:.2f}x verify-all, "
              f"{s['steady'] / t['steady']:.2f}x the threshold, {s['steady'] / res['off'][b]['steady']:.2f}x no speculation")
        if bound is not None:
            print(f"    the best any policy deciding from the confidences keeps (spec/replay.py, kappa "
                  f"{a.concentration}): {bound(max(fewer, 0.0)):.3f} of verify-all's accepted length at "
                  f"{max(fewer, 0.0):.0%} fewer drafts, {bound(0.25):.3f} at 25% fewer")


def checkpoint_layers(ckpt: str) -> int:
    from deepinfer.model.args import ModelArgs
    return ModelArgs.from_checkpoint(Path(ckpt)).n_layers


def report_projection(res: dict, batches: list[int], meta: dict, target: int = FULL_LAYERS) -> None:
    """Steady tok/s per GPU at `target` layers (project_layers): the checkpoint's few layers make the
    drafting pass look several times dearer than it is beside a whole backbone."""
    layers, zero = meta.get("layers"), meta.get("zero_draft_step_s")
    if "off" not in res or not zero or not layers or layers >= target:
        return
    print(f"\nprojected to {target} layers (the checkpoint has {layers}; drafting + bookkeeping = the "
          f"scheduler's zero-draft step minus the plain step, held fixed, times the share of steps that "
          f"drafted):")
    print(f"{'batch':>5} {'policy':>16} {'step ms':>8} {'draft ms':>8} {'step ms @' + str(target):>11} "
          f"{'tok/s/GPU @' + str(target):>14} {'x off':>6}")
    for b in batches:
        off = res["off"][b]
        draft = zero[b] - off["steady_step_s"]
        off_rate = off["steady_tokens_per_step"] / project_layers(off["steady_step_s"], 0.0, layers, target)
        for n in res:
            r = res[n][b]
            drafted = 0.0 if n == "off" else 1.0 - r.get("paused_steps", 0) / max(r["steps"], 1)
            d = draft * drafted          # paused steps (spec_pause) draft nothing
            t = project_layers(r["steady_step_s"], d, layers, target)
            rate = r["steady_tokens_per_step"] / t
            print(f"{b:>5} {n:>16} {r['steady_step_s'] * 1e3:>8.2f} {d * 1e3:>8.2f} {t * 1e3:>11.2f} "
                  f"{rate:>14.1f} {rate / off_rate:>6.2f}")


def oracle_bounds(a):
    """fewer -> the oracle's kept fraction of accepted length under the run's replayed distribution."""
    from deepinfer.spec.replay import ReplayedAcceptance
    from deepinfer.config import EngineArgs
    r = ReplayedAcceptance(a.accepted_length, EngineArgs.num_speculative_tokens, a.concentration)
    return lambda fewer: r.best_accepted_length_ratio(min(fewer, 1.0))


def verified_per_accepted(r: dict) -> float:
    return r["verified"] / r["accepted"] if r["accepted"] else float("nan")


def plot(path: str, res: dict, batches: list[int], title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    names = list(res)
    w = 0.8 / len(names)
    for k, (key, label) in enumerate((("per_user", "tok/s per user"), ("total", "tok/s (all requests)"),
                                      ("steady", "tok/s, whole batch decoding"))):
        ax = axes[k]
        for i, n in enumerate(names):
            ys = [res[n][b][key] / res["off"][b][key] for b in batches]
            ax.bar([j + i * w for j in range(len(batches))], ys, w, label=n)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xticks([j + w * (len(names) - 1) / 2 for j in range(len(batches))], [f"batch {b}" for b in batches])
        ax.set_ylabel(f"{label}, x no speculation")
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--accepted-length", type=float, default=3.5)
    ap.add_argument("--repeats", type=int, default=3,
                    help="timed runs per (policy, batch), each with its own requests and draws (the same "
                         "for every policy): the median rates, the counts summed")
    ap.add_argument("--concentration", type=float, default=2.0,
                    help="the replayed confidences' Beta concentration kappa (spec/replay.py): 2 spreads them "
                         "widely, smaller is sharper (near 0 or 1)")
    ap.add_argument("--regime-tokens", type=int, default=0,
                    help="the replayed confidences persist over regimes of this many positions (spec/replay.py); "
                         "0: drawn independently per proposal")
    ap.add_argument("--threshold", type=float, default=0.5)
    ap.add_argument("--floor", type=float, default=None,
                    help="also run the scheduler with this acceptance floor (EngineArgs.spec_acceptance_floor), "
                         "as the policy 'sched floor F'")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--prefix-caching", action="store_true",
                    help="every engine with enable_prefix_caching (with --async-overlap: 'all async' is how DSpark ran "
                         "with the cache on before 2026-12-06, every verify step resolved first)")
    ap.add_argument("--load-format", default="safetensors", choices=["safetensors", "dummy"])
    ap.add_argument("--routing", default="balanced", choices=["balanced", "model"],
                    help="with --load-format dummy: EngineArgs.dummy_routing (balanced: every expert read, the load a "
                         "trained router approaches; model: the random gates' few experts, as before 2026-12-06)")
    ap.add_argument("--num-cache-blocks", type=int,
                    help="cache blocks per engine (default on CUDA: the workload's, 64-token blocks; CPU: the engine's sizing)")
    ap.add_argument("--variants", action="store_true",
                    help="also the scheduler with the newest confidences for the budget, with early stop, with "
                         "the older confidences at face value (spec_calibrate_older=False), on padded verify graphs, "
                         "with the pause, and with its step times corrected online (spec_step_time_online)")
    ap.add_argument("--policies", nargs="+", help="run only these policies (names as printed)")
    ap.add_argument("--quick", action="store_true", help="prompt 32, output 32, a short warm-up")
    ap.add_argument("--async-overlap", action="store_true",
                    help="instead of the policies: verify-all synchronous, async (verify steps resolved "
                         "first) and async with verify steps that overlap (spec_async_overlap)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="requests at this temperature (top_p 0.95, seeded; 0 = greedy): verify steps of "
                         "sampled requests overlap too")
    ap.add_argument("--acceptance", default="identical", choices=["identical", "sampled"],
                    help="spec_acceptance (sampled: drafts sampled at temperature > 0, min(1, p/q))")
    ap.add_argument("--dense-weights", default="auto", choices=["auto", "fp8", "bf16"],
                    help="EngineArgs.dense_weights: bf16 holds the dense FP8 linears dequantized (cuBLAS at verify widths)")
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for no speculation either")
    ap.add_argument("--json", help="write the measurements here (rewritten after every policy)")
    ap.add_argument("--budget-s", type=float, help="start no further policy once this many seconds have passed")
    ap.add_argument("--plot")
    a = ap.parse_args()
    if a.quick:
        a.prompt_len, a.output_len, a.repeats = min(a.prompt_len, 32), min(a.output_len, 32), 1
    with tempfile.TemporaryDirectory() as tmp:
        if a.checkpoint:
            ckpt = a.checkpoint
        elif a.load_format == "dummy":
            ckpt = config_only_checkpoint(Path(tmp), a.preset)
        else:
            ckpt = default_checkpoint(Path(tmp), a.preset)
        routing = f", {a.routing} routing" if a.load_format == "dummy" else ""
        print(f"checkpoint {ckpt} ({a.load_format}{routing}), device {a.device}, prompt {a.prompt_len}, output {a.output_len}, "
              f"replayed mean accepted length {a.accepted_length} of 5 (verify-all), temperature {a.temperature}, "
              f"acceptance {a.acceptance}", flush=True)
        meta = {"layers": checkpoint_layers(ckpt)}
        res = measure_all(ckpt, a, meta)
    report(res, a.batches, gpus=1, a=a)
    report_projection(res, a.batches, meta)
    print(f"total {time.perf_counter() - T_START:.0f} s")
    if a.json:
        save_json(a, res)
    if a.plot:
        plot(a.plot, res, a.batches, f"DSpark policies, replayed acceptance {a.accepted_length} of 5 "
             f"({Path(ckpt).name}, {a.device})")


if __name__ == "__main__":
    main()
