"""Verify steps that overlap under async scheduling (spec/overlap.py, EngineArgs.spec_async_overlap):
step N+1 is scheduled with the worst-case reservation and launched from N's device-side resolution
before N's accepted counts reach the host. Under batch_invariant=True the tokens equal the
synchronous engine's, with both acceptance rules, with a stop and an abort discovered while an
overlapped step is in flight, with sampled requests beside greedy ones, and with only requests at
temperature > 0 (their seeded positions, drafts and draft probabilities from the device). The
random tiny model accepts almost no draft, so an oracle proposer (the reference tokens, one draft
in four corrupted) makes acceptance lengths 0..K happen: the trim of the worst case (k - a
positions) is exercised at every length."""

from __future__ import annotations

import pytest
import torch

from deepinfer import EngineArgs, SamplingParams
from deepinfer.engine import Engine
from tests.engine.conftest import drain, greedy, sampled

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[(7 * i) % 1000 + 10 for i in range(30)], list(range(500, 520)), [3, 4, 5], [9] * 12]
N_OUT = 20


@pytest.fixture(scope="module")
def args(spec_args):
    return spec_args


def _budget_policy():
    """A step-time model under which a draft pays only when its survival is high enough: t(n, B) =
    1 + 0.1 B for 1 <= n <= 4 (the grid is by drafts per request x = B / n), so the budget stops
    well short of every draft."""
    from deepinfer.spec.budget import VerifyBudgetPolicy
    from deepinfer.spec.step_time import StepTimeModel
    sizes = [1, 4]
    seconds = [[1.0 + 0.1 * n * x for x in range(6)] for n in sizes]
    return VerifyBudgetPolicy(StepTimeModel(sizes, list(range(6)), seconds))


def numbered(prompts: list[list[int]], first: int = 0) -> dict[str, list[int]]:
    """Request ids (numbers: the oracle corrupts by them) -> prompts."""
    return {str(first + i): p for i, p in enumerate(prompts)}


def oracle_drafts(engine: Engine, ref: dict[str, list[int]], prompts: dict[str, list[int]] | None = None) -> None:
    """Both drafting paths propose the reference continuation, one draft in four corrupted (by
    request and position), so verify steps accept 0..K drafts. prompts: request id -> prompt
    (default: PROMPTS as "0".."3")."""
    runner, vocab = engine.runner, engine.vocab_size
    prompts = prompts or numbered(PROMPTS)

    def token(req_id: str, pos: int) -> int:
        i = int(req_id)
        full = prompts[req_id] + ref[req_id]
        tok = full[pos] if pos < len(full) else 0
        return (tok + 1) % vocab if (3 * pos + i) % 4 == 0 else tok

    def req_of_slot() -> dict[int, str]:
        ib = runner.input_batch
        return {int(ib.ring_slot[row]): r for r, row in ib.row_of.items()}

    proposer = runner.proposer
    host_propose = proposer.propose

    def propose(anchor_ids, positions, ring_slots, sampling=None):
        props = host_propose(anchor_ids, positions, ring_slots, sampling=sampling)
        owner, k = req_of_slot(), proposer.num_speculative_tokens
        props.draft_ids = [[token(owner[s], p + 2 + j) for j in range(k)] for p, s in zip(positions, ring_slots)]
        return props

    proposer.propose = propose
    if runner.overlapped is None:
        return
    device_draft = runner.overlapped.draft

    def draft_on_device(main_hidden, positions, q_lens, rows, res):
        ids, conf, q = device_draft(main_hidden, positions, q_lens, rows, res)
        owner = {row: r for r, row in runner.input_batch.row_of.items()}
        nxt = res.next_pos.tolist()        # CPU: a test may read it; the engine does not
        want = [[token(owner[int(row)], nxt[b] + 1 + j) for j in range(ids.shape[1])] for b, row in enumerate(rows)]
        return torch.tensor(want, dtype=ids.dtype, device=ids.device), conf, q

    runner.overlapped.draft = draft_on_device


def run(engine: Engine, plist, abort=None, prompts: dict[str, list[int]] | None = None,
        logprobs: dict[str, list] | None = None):
    """Step to the end; abort = (req_id, n): abort it right after the step() in which it has received
    n tokens; prompts: request id -> prompt, in plist's order (default: PROMPTS as "0".."3"); -> (tokens,
    finish reasons, whether the step in flight at the abort held it and was an overlapped one, the
    requests that stopped with an overlapped step holding them in flight). logprobs: filled with each
    request's token logprobs."""
    prompts = prompts or numbered(PROMPTS)
    for (rid, prompt), sp in zip(prompts.items(), plist):
        engine.add_request(rid, prompt, sp)
    got, reasons, abort_in_overlap, stopped_in_overlap = {rid: [] for rid in prompts}, {}, None, set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
            if logprobs is not None:
                logprobs.setdefault(out.request_id, []).extend(out.new_logprobs or [])
            if out.finished:
                reasons[out.request_id] = out.finish_reason
                f = engine._in_flight
                if f is not None and f[0].overlapped and out.request_id in f[0].num_scheduled_tokens:
                    stopped_in_overlap.add(out.request_id)
        if abort is not None and len(got[abort[0]]) >= abort[1] and abort[0] not in reasons:
            f = engine._in_flight
            abort_in_overlap = f is not None and f[0].overlapped and abort[0] in f[0].num_scheduled_tokens
            engine.abort(abort[0])
            reasons[abort[0]] = "abort"
        engine.kv_cache.check()
    assert engine.kv_cache.num_used_blocks == 0
    return got, reasons, abort_in_overlap, stopped_in_overlap


@pytest.fixture(scope="module")
def ref(args):
    """The synchronous engine's tokens (speculation on, real drafts)."""
    return run(Engine(EngineArgs(**args)), [greedy(N_OUT) for _ in PROMPTS])[0]


@pytest.mark.parametrize("rule", ["identical", "sampled"])
def test_overlapped_verify_steps_equal_sync(args, ref, rule):
    a = Engine(EngineArgs(**args, spec_acceptance=rule, async_scheduling=True))
    assert a.args.spec_async_overlap and a.runner.overlapped is not None
    oracle_drafts(a, ref)
    got = run(a, [greedy(N_OUT) for _ in PROMPTS])[0]
    assert got == ref
    c = a.stats.snapshot()["counters"]
    verified, accepted = c["spec_draft_tokens_verified_total"], c["spec_draft_tokens_accepted_total"]
    assert 0.3 * verified < accepted < verified           # the oracle: long and short acceptances
    assert a.num_verify_steps_overlapped >= 4
    if rule == "identical":      # the pipeline breaks less often than with every verify step resolved first
        b = Engine(EngineArgs(**args, async_scheduling=True, spec_async_overlap=False))
        oracle_drafts(b, ref)
        assert run(b, [greedy(N_OUT) for _ in PROMPTS])[0] == ref
        assert b.num_verify_steps_overlapped == 0
        assert a.num_resolved_before_schedule < b.num_resolved_before_schedule


def test_overlap_with_stop_and_abort_in_flight(args, ref):
    """Request 3 stops on its 9th token, found by the host while an overlapped step holding it runs
    (that step's tokens for it are dropped); request 1 is aborted while an overlapped step holding
    it is in flight; the others keep the reference tokens."""
    stop_tok = ref["3"][8]
    plist = [greedy(N_OUT) for _ in PROMPTS]
    plist[3] = greedy(N_OUT, stop_token_ids=[stop_tok])
    a = Engine(EngineArgs(**args, async_scheduling=True))
    oracle_drafts(a, ref)
    got, reasons, abort_in_overlap, stopped_in_overlap = run(a, plist, abort=("1", 6))
    assert abort_in_overlap, "the aborted request was not in an overlapped step in flight"
    assert "3" in stopped_in_overlap, "the stop was not found with an overlapped step holding it in flight"
    first = ref["3"].index(stop_tok)
    assert reasons["3"] == "stop" and got["3"] == ref["3"][:first + 1]
    assert reasons["1"] == "abort" and 6 <= len(got["1"]) < N_OUT and got["1"] == ref["1"][:len(got["1"])]
    assert got["0"] == ref["0"] and got["2"] == ref["2"]
    assert a.num_verify_steps_overlapped > 0


def test_sampled_requests_beside_greedy_ones(args, ref):
    """Requests at temperature > 0 (sampled rule) beside greedy ones, all under async + overlap:
    every token equals the synchronous engine's with the same drafts (under the sampled rule a token
    depends on the drafts; the reference once drafted for real while this engine took the oracle's, and
    the two agreed only by chance: not on an AVX-512 host, 2026-12-06)."""
    plist = [greedy(N_OUT), sampled(4, 1), sampled(3, 2), greedy(N_OUT)]
    s = Engine(EngineArgs(**args, spec_acceptance="sampled"))
    oracle_drafts(s, ref)
    want = run(s, plist)[0]
    a = Engine(EngineArgs(**args, spec_acceptance="sampled", async_scheduling=True))
    oracle_drafts(a, ref)
    got = run(a, plist)[0]
    assert got == want and got["0"] == ref["0"] and got["3"] == ref["3"]
    assert a.num_verify_steps_overlapped > 0 and a.num_resolved_before_schedule > 0


@pytest.mark.parametrize("rule", ["identical", "sampled"])
def test_logprobs_requests_overlap(args, ref, rule):
    """Requests asking for logprobs (greedy, and one at temperature > 0) overlap their verify steps: the
    logprobs come from the device (raw log_softmax, the sampled token's and the top n) and equal the
    synchronous engine's Sampler's, as do the tokens."""
    plist = [greedy(N_OUT, logprobs=3), greedy(N_OUT), greedy(N_OUT, logprobs=0),
             SamplingParams(max_tokens=N_OUT, temperature=8.0, top_p=0.95, seed=7, ignore_eos=True, logprobs=2)]
    want_lp, got_lp = {}, {}
    sync = Engine(EngineArgs(**args, spec_acceptance=rule))
    oracle_drafts(sync, ref)          # the same drafts: a sampled row's token depends on the draft it verifies
    want = run(sync, plist, logprobs=want_lp)[0]
    a = Engine(EngineArgs(**args, spec_acceptance=rule, async_scheduling=True))
    oracle_drafts(a, ref)
    got = run(a, plist, logprobs=got_lp)[0]
    assert got == want and got["0"] == ref["0"]
    assert a.num_verify_steps_overlapped >= 4
    for rid in ("0", "2", "3"):
        assert len(got_lp[rid]) == len(got[rid]) and all(lp is not None for lp in got_lp[rid])
        assert got_lp[rid] == want_lp[rid], rid
    assert [len(lp.top) for lp in got_lp["0"]] == [3] * N_OUT and all(not lp.top for lp in got_lp["2"])
    assert not any(got_lp.get("1") or [])


@pytest.mark.parametrize("rule", ["identical", "sampled"])
def test_penalized_requests_overlap(args, ref, rule):
    """Requests with presence / frequency penalties (greedy, and one at temperature > 0, with logprobs)
    overlap their verify steps: each row's counts are the host's outputs, the unresolved step's new tokens
    and the drafts fed before it, all on the device; the tokens equal the synchronous engine's Sampler's (the
    tiny model's random outputs seldom repeat a token: large negative penalties make them repeat)."""
    plist = [greedy(N_OUT, presence_penalty=-60.0), greedy(N_OUT), greedy(N_OUT, frequency_penalty=-40.0, logprobs=1),
             SamplingParams(max_tokens=N_OUT, temperature=8.0, top_p=0.95, seed=7, ignore_eos=True,
                            presence_penalty=30.0, frequency_penalty=20.0)]
    sync = Engine(EngineArgs(**args, spec_acceptance=rule))
    oracle_drafts(sync, ref)
    want_lp, got_lp = {}, {}
    want = run(sync, plist, logprobs=want_lp)[0]
    a = Engine(EngineArgs(**args, spec_acceptance=rule, async_scheduling=True))
    oracle_drafts(a, ref)
    got = run(a, plist, logprobs=got_lp)[0]
    assert got == want and got_lp["2"] == want_lp["2"]
    assert got["0"] != ref["0"] and got["2"] != ref["2"]        # the penalties changed the greedy tokens
    assert a.num_verify_steps_overlapped >= 4


def _sampled_plist(n, stop=None):
    """Requests at temperature > 0 only: top-p (conftest.sampled) and one with top-k and min-p."""
    plist = [sampled(n, 11 + i) for i in range(len(PROMPTS))]
    plist[2] = SamplingParams(max_tokens=n, temperature=6.0, top_k=40, min_p=0.01, seed=5, ignore_eos=True)
    if stop is not None:
        plist[3] = SamplingParams(max_tokens=n, temperature=8.0, top_p=0.95, seed=14, ignore_eos=True,
                                  stop_token_ids=[stop])
    return plist


@pytest.mark.parametrize("rule", ["identical", "sampled"])
def test_sampled_requests_overlap(args, rule):
    """Only requests at temperature > 0 in the batch (seeded, top-p / top-k / min-p): their verify
    steps overlap (the seeded streams' positions, the drafts and, under "sampled", q come from the
    previous step's device tensors), with a stop and an abort found while an overlapped step holds
    them, and the tokens equal sync + speculation. "identical": every token (the rule's tokens are
    plain decoding's whatever was verified). "sampled": the tokens depend on how many drafts were
    verified, and near max_tokens the worst case verifies fewer than the synchronous schedule, so
    the last 2 (K + 1) tokens are left out (as replay mode)."""
    n, k = 28, 5
    plain = run(Engine(EngineArgs(**args)), _sampled_plist(n))[0]     # identical rule: plain decoding's tokens
    sync = Engine(EngineArgs(**args, spec_acceptance=rule))
    oracle_drafts(sync, plain)
    base = run(sync, _sampled_plist(n))[0]
    if rule == "identical":
        assert base == plain
    stop_tok = base["3"][8]
    a = Engine(EngineArgs(**args, spec_acceptance=rule, async_scheduling=True))
    oracle_drafts(a, plain)
    launch_overlapped, with_q = a.runner.launch_overlapped, []

    def recorded(sched_out, prev):       # did the step verify sampled drafts with the device's q?
        with_q.append(prev.draft_probs_dev is not None)
        return launch_overlapped(sched_out, prev)

    a.runner.launch_overlapped = recorded
    got, reasons, abort_in_overlap, stopped_in_overlap = run(a, _sampled_plist(n, stop_tok), abort=("1", 6))
    assert a.num_verify_steps_overlapped >= 4
    assert all(with_q) == (rule == "sampled") and any(with_q) == (rule == "sampled")
    assert abort_in_overlap, "the aborted request was not in an overlapped step in flight"
    assert "3" in stopped_in_overlap, "the stop was not found with an overlapped step holding it in flight"
    first = base["3"].index(stop_tok)
    assert reasons["3"] == "stop" and got["3"] == base["3"][:first + 1]
    assert reasons["1"] == "abort" and 6 <= len(got["1"]) < n and got["1"] == base["1"][:len(got["1"])]
    keep = n if rule == "identical" else n - 2 * (k + 1)
    assert all(len(got[r]) == n and got[r][:keep] == base[r][:keep] for r in ("0", "2"))
    c = a.stats.snapshot()["counters"]
    assert 0 < c["spec_draft_tokens_accepted_total"] < c["spec_draft_tokens_verified_total"]


def test_replayed_acceptance_with_overlap(args):
    """Benchmark mode (spec_replay_accepted_length): a proposal made on the device reads its replayed
    outcome from the table drawn when the request was added, the same draw the host makes, so the
    accepted drafts and tokens equal the synchronous engine's, except within 2 (K + 1) tokens of
    max_tokens, where the worst case may verify fewer drafts than the synchronous schedule (and a
    replayed outcome accepts min(L, verified) of the proposed ids)."""
    n, k = 24, 5
    replay = {**args, "spec_policy": "all", "spec_replay_accepted_length": 3.5}
    want = run(Engine(EngineArgs(**replay)), [greedy(n) for _ in PROMPTS])[0]
    a = Engine(EngineArgs(**replay, async_scheduling=True))
    # a device-made proposal carries the replayed confidences the host draws for it (the overlapped
    # policy splits its budget by them on the device)
    from_device, compared = a.runner._drafts_from_device, []

    def checked(step, per_req):
        drafts, confs = from_device(step, per_req)
        on_device = step.drafts_host[1].tolist()
        for i, c in enumerate(confs):
            if c:
                assert on_device[i] == pytest.approx(c, rel=1e-5, abs=1e-5)
                compared.append(i)
        return drafts, confs

    a.runner._drafts_from_device = checked
    got = run(a, [greedy(n) for _ in PROMPTS])[0]
    assert a.num_verify_steps_overlapped > 0 and len(compared) > 10
    assert all(len(got[r]) == n and got[r][:n - 2 * (k + 1)] == want[r][:n - 2 * (k + 1)] for r in want)
    c = a.stats.snapshot()["counters"]
    assert c["spec_draft_tokens_accepted_total"] > 0.4 * c["spec_draft_tokens_verified_total"]


def _cuda_args(tiny_engine_args) -> dict:
    return {**tiny_engine_args, "device": "cuda", "max_num_batched_tokens": 64, "speculative": "dspark",
            "spec_policy": "all", "async_scheduling": True, "cuda_graph_sizes": (1, 2, 4, 8)}


def _strict(fn, calls: list):
    """fn under sync debug mode "error" (any call that makes the host wait for the device raises)."""
    def wrapped(*a, **kw):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return fn(*a, **kw)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            calls.append(1)
    return wrapped


class _ScriptedPauses:
    """Verify every draft; draft after a step as the script says (cycled)."""

    def __init__(self, script):
        self.script = script
        self.i = 0

    def assign(self, entries):
        return [e.num_drafts for e in entries]

    def draft_after(self, num_seqs: int) -> bool:
        self.i += 1
        return self.script[(self.i - 1) % len(self.script)]


def _counting_replays(runner, launch, replays: list, on_call=lambda sched_out: None):
    """launch_overlapped wrapped: each call's number of graph replays appended to replays."""
    def counted(sched_out, prev):
        on_call(sched_out)
        before = runner.graphs.num_replays
        try:
            return launch(sched_out, prev)
        finally:
            replays.append(runner.graphs.num_replays - before)
    return counted


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_overlapped_build_does_not_sync_on_cuda(tiny_engine_args, monkeypatch):
    """The build of an overlapped verify step on the GPU: its inputs gathered from the previous
    step's resolution (spec/overlap.step_inputs) and the static verify and drafting buffers filled
    from them (fill_on_device) make no call that waits for the device."""
    from deepinfer.model.dspark import DraftStepBuffers
    from deepinfer.model.step_metadata import DecodeStepBuffers
    from deepinfer.worker import overlapped_step
    calls = []
    monkeypatch.setattr(overlapped_step, "step_inputs", _strict(overlapped_step.step_inputs, calls))
    monkeypatch.setattr(DecodeStepBuffers, "fill_on_device", _strict(DecodeStepBuffers.fill_on_device, calls))
    monkeypatch.setattr(DraftStepBuffers, "fill_on_device", _strict(DraftStepBuffers.fill_on_device, calls))
    e = Engine(EngineArgs(**_cuda_args(tiny_engine_args)))
    got = run(e, [greedy(N_OUT) for _ in PROMPTS])[0]
    assert e.num_verify_steps_overlapped > 0 and len(calls) >= 3 * e.num_verify_steps_overlapped
    assert all(len(t) == N_OUT for t in got.values())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("policy", ["all", "scheduler", "pause", "prefix", "logprobs"])
def test_overlapped_launch_does_not_sync_on_cuda(tiny_engine_args, policy):
    """The whole launch of an overlapped verify step on the GPU (the build, the captured verify
    graph's replay, the greedy sample, the device-side resolution, the DSpark absorb of every row
    and the drafting graph's replay, the host copies) without the host waiting for the stream:
    launch_overlapped under sync debug mode "error"; every overlapped step replays its graph.
    "scheduler": the host's split of its budget lays out fewer drafts than the block (packed steps:
    the device verifies every draft laid out). "pause": steps scheduled with draft_after=False
    (spec/pause.py) absorb on the device and propose nothing, inside the same strict launch. "prefix":
    "all" with prefix caching on (the window snapshots' copies to pinned memory in the launch). "logprobs":
    "all" with every request asking for logprobs (computed and copied at the launch) and penalties (their
    counts built on the device)."""
    args = _cuda_args(tiny_engine_args)
    if policy == "prefix":
        args = {**args, "enable_prefix_caching": True}
    e = Engine(EngineArgs(**args))
    K = e.args.num_speculative_tokens
    if policy == "scheduler":
        e.scheduler.draft_book.policy = _budget_policy()
    if policy == "pause":
        e.scheduler.draft_book.policy = _ScriptedPauses([True, True, True, False])
    runner = e.runner
    assert runner.overlapped is not None and runner.graphs is not None and runner.graphs.graphs is not None
    calls, replays, cuts = [], [], []
    strict = _strict(runner.launch_overlapped, calls)

    def cut(sched_out):            # the share of requests laid out with fewer drafts than the block
        ks = [len(v) for v in sched_out.spec_tokens.values()]
        cuts.append(sum(k < K for k in ks) / max(len(ks), 1))

    runner.launch_overlapped = _counting_replays(runner, strict, replays, cut)
    # long outputs: max_tokens caps the drafts of a request's last steps under every policy (on the H200 the
    # tiny model accepts so much that 20 tokens took ~4 steps, half of them capped, under "all")
    n_out = 3 * N_OUT
    lp = {"logprobs": 2, "presence_penalty": 0.5, "frequency_penalty": 0.25} if policy == "logprobs" else {}
    ref = run(Engine(EngineArgs(**{**args, "async_scheduling": False})), [greedy(n_out, **lp) for _ in PROMPTS])[0]
    got_lp = {}
    got = run(e, [greedy(n_out, **lp) for _ in PROMPTS], logprobs=got_lp)[0]
    assert all(len(got_lp.get(r, [])) == (n_out if lp else 0) for r in ref)
    assert e.num_verify_steps_overlapped > 0 and len(replays) == e.num_verify_steps_overlapped
    assert all(r == 1 for r in replays), replays          # every overlapped step replayed its graph
    assert (sum(cuts) / len(cuts) > 0.5) == (policy == "scheduler"), cuts
    if policy == "pause":
        assert e.stats.snapshot()["counters"]["spec_paused_steps_total"] > 0
    assert all(len(t) == n_out for t in got.values())
    # not batch-invariant on the GPU: the batches differ, so only the first tokens must agree
    assert all(got[r][:2] == ref[r][:2] for r in ref)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rule", ["identical", "sampled"])
def test_sampled_overlapped_launch_does_not_sync_on_cuda(tiny_engine_args, rule):
    """Only requests at temperature > 0 (top-p, top-k + min-p): the whole overlapped launch on the GPU,
    the seeded draws mixed on the device (and under "sampled" the drafts sampled on the device, the
    accept / residual draws with the device's q), under sync debug mode "error"; the verify steps
    replay their graphs (sampled drafting runs eagerly)."""
    args = {**_cuda_args(tiny_engine_args), "spec_acceptance": rule}
    e = Engine(EngineArgs(**args))
    runner = e.runner
    calls, replays = [], []
    strict = _strict(runner.launch_overlapped, calls)

    runner.launch_overlapped = _counting_replays(runner, strict, replays)
    got = run(e, _sampled_plist(N_OUT))[0]
    assert e.num_verify_steps_overlapped > 0 and len(replays) == e.num_verify_steps_overlapped
    assert all(r == 1 for r in replays), replays
    assert all(len(t) == N_OUT for t in got.values()) and len({tuple(t) for t in got.values()}) == len(got)


@pytest.mark.parametrize("kind", ["greedy", "sampled"])
def test_overlapped_steps_through_the_graph_path_on_cpu(args, ref, kind):
    """cuda_graph_sizes on a CPU: the captured-step code path (DecodeGraphs.step_on_device and the
    drafting graphs' static buffers, run eagerly on the padded buffers) serves the overlapped
    steps; not batch-invariant (graphs are off with it), so the tokens are compared with the
    synchronous engine on the same path. "sampled": requests at temperature > 0 (identical rule)."""
    g = {**args, "batch_invariant": False, "cuda_graph_sizes": (1, 2, 4, 8)}
    plist = (lambda: [greedy(N_OUT) for _ in PROMPTS]) if kind == "greedy" else lambda: _sampled_plist(N_OUT)
    want = run(Engine(EngineArgs(**g)), plist())[0]
    e = Engine(EngineArgs(**g, async_scheduling=True))
    graphs = e.runner.graphs
    served = []
    step_on_device = graphs.step_on_device
    graphs.step_on_device = lambda inputs, key: served.append(key) or step_on_device(inputs, key)
    oracle_drafts(e, ref)
    got = run(e, plist())[0]
    assert e.num_verify_steps_overlapped > 0 and len(served) == e.num_verify_steps_overlapped
    assert got == want


@pytest.mark.parametrize("policy", ["scheduler", "threshold"])
def test_overlapped_steps_honour_the_verification_policy(args, ref, policy, monkeypatch):
    """Overlapped verify steps verify k_i <= K' drafts picked by the policy (spec/overlap_verify.py:
    the budget B from the older confidences on the host, K' capped by its split there (packed steps
    cost the rows laid out, so the device verifies all of them); the threshold on the device): the tokens stay the synchronous engine's (greedy rule: the policy
    changes how many drafts are verified, never which tokens come out), fewer drafts are verified
    than by overlapped verify-all, and each device split equals split_budget on the host."""
    from deepinfer.spec.budget import split_budget
    from deepinfer.spec.policy import DraftEntry
    from deepinfer.worker import overlapped_step
    seen = []
    device_counts = overlapped_step.verified_counts

    def recorded(plan, conf, num_drafts):
        k = device_counts(plan, conf, num_drafts)
        seen.append((plan, conf.tolist(), num_drafts.tolist(), k.tolist()))
        return k

    monkeypatch.setattr(overlapped_step, "verified_counts", recorded)
    from deepinfer.sched import scheduler as scheduler_module
    host_half, olders, worst = scheduler_module.plan_overlapped, [], []
    monkeypatch.setattr(scheduler_module, "plan_overlapped",
                        lambda p, n, o: olders.append(o) or worst.append(sum(n)) or host_half(p, n, o))
    kw = dict(args, async_scheduling=True)
    if policy == "threshold":
        kw["spec_confidence_threshold"] = 0.3
    a = Engine(EngineArgs(**kw))
    if policy == "scheduler":
        a.scheduler.draft_book.policy = _budget_policy()
    oracle_drafts(a, ref)
    assert run(a, [greedy(N_OUT) for _ in PROMPTS])[0] == ref
    assert len(seen) >= a.num_verify_steps_overlapped >= 4     # every overlapped launch is counted
    # the host half had every request's previous proposal (two steps old) once the chain ran a while
    assert len(olders) == len(seen) and all(o is not None for older in olders[2:] for o in older)
    assert len({tuple(older[0]) for older in olders}) > len(olders) // 2      # kept fresh (DraftBook.remember)
    plans = [p for p, *_ in seen if p is not None]
    if policy == "scheduler":       # B split on the host; the device verifies every draft laid out
        assert not plans
    else:
        assert plans and all(p.threshold is not None and p.budget is None for p in plans)
    verified = sum(sum(k) for *_, k in seen)
    assert 0 < verified < sum(worst)          # some drafts were not verified (packed steps: cut on the host)
    for plan, conf, num, k in seen:
        assert all(0 <= ki <= ni for ki, ni in zip(k, num))
        if plan is not None and plan.budget is not None:
            entries = [DraftEntry(n, c) for n, c in zip(num, conf) if n > 0]
            want = iter(split_budget(entries, plan.budget))
            assert k == [next(want) if n > 0 else 0 for n in num]
    # the counters count the verified drafts, not the scheduled worst case
    b = Engine(EngineArgs(**dict(args, async_scheduling=True)))     # threshold 0: verify all
    oracle_drafts(b, ref)
    assert run(b, [greedy(N_OUT) for _ in PROMPTS])[0] == ref
    ca, cb = a.stats.snapshot()["counters"], b.stats.snapshot()["counters"]
    assert ca["spec_draft_tokens_verified_total"] < cb["spec_draft_tokens_verified_total"]


@pytest.mark.parametrize("overlap", [True, False])
def test_packed_verify_graphs_cost_the_rows_verified(args, ref, overlap, monkeypatch):
    """cuda_graph_sizes on a CPU runs the captured steps' code eagerly: with the budget scheduler the
    verify steps take packed keys holding fewer rows than batch x longest request, and the tokens
    are those of the same engine with padded verify graphs (not batch-invariant: graphs are off
    with it; the packed step itself is bitwise the dynamic one, tests/worker/test_graph_verify.py)."""
    from deepinfer.worker.graph_step import DecodeGraphs
    keys_used = []
    serves = DecodeGraphs.serves

    def recorded(self, n, max_position, length=1, rows=None):
        key = serves(self, n, max_position, length, rows)
        if key is not None and length > 1:
            keys_used.append((n, length, rows, key))
        return key

    g = {**args, "batch_invariant": False, "cuda_graph_sizes": (1, 2, 4, 8), "async_scheduling": overlap,
         "spec_async_overlap": overlap}
    padded = Engine(EngineArgs(**g, spec_packed_verify=False))
    padded.scheduler.draft_book.policy = _budget_policy()       # the same plans: a budget split, no cap
    oracle_drafts(padded, ref)
    want = run(padded, [greedy(N_OUT) for _ in PROMPTS])[0]
    keys_used.clear()
    monkeypatch.setattr(DecodeGraphs, "serves", recorded)
    e = Engine(EngineArgs(**g))
    assert e.runner.graphs.keys.packed
    e.scheduler.draft_book.policy = _budget_policy()
    oracle_drafts(e, ref)
    assert run(e, [greedy(N_OUT) for _ in PROMPTS])[0] == want
    assert keys_used and all(b >= n and b * q >= rows for n, _, rows, (b, q) in keys_used)
    assert any(b * q < n * length for n, length, _, (b, q) in keys_used)   # a step shorter than padded
    assert e.runner.graphs.num_verify_steps > 0




def test_image_requests_overlap(args):
    """Requests with images overlap like text ones, with the synchronous engine's tokens: first one
    whose prompt ends with its image span alone (the first overlapped step's Engram look-back reads
    the span's positions: dead, from the host's history), then one with an image mid-prompt beside
    it and a text request. Before, one image request in a step kept the batch from overlapping."""
    from tests.engine.test_engine_images import IMG, png
    phases = [{"0": ([11, 12, 13, IMG], [png(60, 90, 2)])},
              {"1": ([5, 6, IMG, 7, 8, 9], [png(90, 60, 1)]), "2": ([11, 12, 13, IMG], [png(60, 90, 2)]),
               "3": (PROMPTS[0], None)}]

    def tokens(engine):
        got, overlapped = {}, []
        for reqs in phases:
            before = engine.num_verify_steps_overlapped
            for rid, (prompt, images) in reqs.items():
                engine.add_request(rid, prompt, greedy(N_OUT), images=images)
            got.update(drain(engine)[0])
            overlapped.append(engine.num_verify_steps_overlapped - before)
        return got, overlapped

    want, _ = tokens(Engine(EngineArgs(**args)))
    got, overlapped = tokens(Engine(EngineArgs(**args, async_scheduling=True)))
    assert got == want
    assert min(overlapped) >= 4, overlapped
