"""DSpark speculative decoding in the engine (deepinfer/spec/): outputs equal plain decoding
(greedy and seeded sampling), through preemption and abort mid-speculation; the DSpark rings hold
accepted positions only (drafts equal a clean sequential absorb); the policy.

NOTE: the tiny model (fp8 fake quant, bf16) is chaotic at the last bit, and a prompt prefilled in
other chunks can flip a near-tie argmax (e.g. [9]*12, output 13: gap 0.7 in logits ~97) without
any drafts. Drafts take budget, so they move other requests' chunk boundaries: the exact-parity
tests give the budget room for every prompt at once; the preemption test (a recompute is a new
chunking) allows a divergence only at a near-tie of the plain run."""

from __future__ import annotations

import pytest
import torch

from deepinfer import EngineArgs, LLM, SamplingParams
from deepinfer.engine import Engine

PROMPTS = [list(range(500, 530)), [3, 4, 5], [(7 * i) % 1000 + 10 for i in range(150)], [9] * 12]
MAX_TOKENS = [14, 9, 12, 16]


@pytest.fixture(scope="module")
def spec_args(tiny_engine_args):
    # every prompt prefilled whole in the first step; 150 + 12 positions fill the 128-token DSpark window
    return {**tiny_engine_args, "max_num_batched_tokens": 512, "num_cache_blocks": 80}


def params(max_tokens, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **kw)


def run(engine: Engine, prompts, plist, abort_at=None, gaps=None):
    """Step to the end; abort_at = (req_id, when): abort it once it holds drafts (waiting for their plan) and `when` steps
    passed; gaps: a dict that receives each request's top-2 logit gap per output token."""
    for i, (p, sp) in enumerate(zip(prompts, plist)):
        engine.add_request(str(i), p, sp, return_logits=gaps is not None)
    got, step = {str(i): [] for i in range(len(prompts))}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
            if gaps is not None and out.logits is not None and len(out.logits):
                top2 = torch.from_numpy(out.logits).topk(2, dim=-1).values
                gaps.setdefault(out.request_id, []).extend((top2[:, 0] - top2[:, 1]).tolist())
        step += 1
        if abort_at is not None:
            req = engine.scheduler.requests.get(abort_at[0])
            if req is not None and engine.scheduler.draft_book.pending(abort_at[0]) and step >= abort_at[1]:
                engine.abort(abort_at[0])
                abort_at = None
        engine.kv_cache.check()
    assert engine.kv_cache.num_used_blocks == 0
    return got, step


@pytest.fixture(scope="module")
def plain(spec_args):
    gaps = {}
    got, steps = run(Engine(EngineArgs(**spec_args)), PROMPTS, [params(n) for n in MAX_TOKENS], gaps=gaps)
    return got, steps, gaps


def assert_equal_up_to_near_ties(got: list[int], want: list[int], gaps: list[float], tie: float = 1.5):
    """Equal, or equal up to a position where the plain run's top-2 logits were within `tie`."""
    i = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if i is not None:
        assert gaps[i] < tie, f"diverged at output {i} (plain top-2 gap {gaps[i]:.2f}): {got} vs {want}"


@pytest.mark.parametrize("threshold", [0.0, 0.5])
def test_greedy_outputs_equal_plain_decoding(spec_args, plain, threshold):
    """threshold 0 verifies all 5 drafts every step (most rejected: rollback every step)."""
    engine = Engine(EngineArgs(**spec_args, speculative="dspark", spec_policy="threshold", spec_confidence_threshold=threshold))
    got, _ = run(engine, PROMPTS, [params(n) for n in MAX_TOKENS])
    assert got == plain[0]
    c = engine.stats.snapshot()["counters"]
    assert c["spec_draft_tokens_proposed_total"] > 0
    assert c["spec_draft_tokens_accepted_total"] <= c["spec_draft_tokens_verified_total"]
    if threshold == 0.0:
        assert c["spec_draft_tokens_verified_total"] > c["spec_verify_steps_total"] > 0
    g = engine.stats.snapshot()["gauges"]
    if c["spec_verify_steps_total"]:
        assert g["spec_mean_accepted_length"] == pytest.approx(
            1 + c["spec_draft_tokens_accepted_total"] / c["spec_verify_steps_total"])


def test_preemption_and_abort_mid_speculation(spec_args, plain):
    """A cache too small for all four: the newest are preempted (their drafts dropped, rings rebuilt
    by the recompute); request 1 is aborted while it holds drafts."""
    args = {**spec_args, "num_cache_blocks": 24}
    engine = Engine(EngineArgs(**args, speculative="dspark", spec_policy="threshold", spec_confidence_threshold=0.0))
    got, _ = run(engine, PROMPTS, [params(n) for n in MAX_TOKENS], abort_at=("1", 2))
    c = engine.stats.snapshot()["counters"]
    assert c["preemptions_total"] > 0 and c["requests_finished_abort"] == 1
    for rid in ("0", "2", "3"):
        assert len(got[rid]) == len(plain[0][rid])
        assert_equal_up_to_near_ties(got[rid], plain[0][rid], plain[2][rid])
    assert len(got["1"]) < MAX_TOKENS[1]
    assert_equal_up_to_near_ties(got["1"], plain[0]["1"][:len(got["1"])], plain[2]["1"])


def test_seeded_sampling_equals_plain_decoding(spec_args):
    """Temperature > 0: the greedy draft is a point mass, so verifying it against the seeded
    per-position sample is lossless speculative sampling, and the tokens are those of a plain run.
    Temperature 8: the tiny model's ~100-wide logits make a temperature ~1 sample its argmax. Both runs in
    batch-invariant mode: a verify step's logits then equal a plain step's bit for bit, so the equality holds
    on any CPU (without it a near-tie flipped the third token on one machine: the verify step's wider GEMMs
    round differently)."""
    plist = [SamplingParams(max_tokens=10, temperature=8.0, top_p=0.95, seed=s, ignore_eos=True) for s in (1, 2)]
    plist.append(SamplingParams(max_tokens=10, temperature=8.0, seed=3, presence_penalty=0.5, ignore_eos=True))
    prompts = PROMPTS[:2] + [PROMPTS[3]]
    args = {**spec_args, "batch_invariant": True}
    want, _ = run(Engine(EngineArgs(**args)), prompts, plist)
    engine = Engine(EngineArgs(**args, speculative="dspark", spec_policy="threshold", spec_confidence_threshold=0.0))
    got, _ = run(engine, prompts, plist)
    assert got == want
    assert engine.stats.snapshot()["counters"]["spec_draft_tokens_verified_total"] > 0


def test_rings_hold_accepted_positions_only(spec_args):
    """Every proposal the engine makes (batched, after rollbacks of rejected drafts) equals the
    proposal of a clean sequential absorb of the final tokens up to the same position.
    NOTE: rows of rejected positions p+1.. could not be read anyway (a draft reads positions <= p,
    and the next steps rewrite p+1.. before any proposal reaches them); the runner still absorbs
    accepted rows only. This checks the plumbing: anchors, positions, ring slots, row selection."""
    from deepinfer.model.simple import SequenceRunner

    engine = Engine(EngineArgs(**spec_args, speculative="dspark", spec_policy="threshold", spec_confidence_threshold=0.0))
    proposer, seen = engine.runner.proposer, []
    inner = proposer.propose

    def record(anchors, positions, slots, **kw):
        out = inner(anchors, positions, slots, **kw)
        mine = [i for i, s in enumerate(slots) if s == engine.kv_cache.ring_slot.get("0")]
        seen.extend((anchors[i], positions[i], out.draft_ids[i], out.confidences[i]) for i in mine)
        return out

    proposer.propose = record
    prompt = PROMPTS[2][:40]
    got, _ = run(engine, [prompt, PROMPTS[1]], [params(10), params(6)])
    assert len(seen) >= 6
    tokens = prompt + got["0"]
    ref = SequenceRunner(engine.model, len(tokens) + 8, torch.device("cpu"), block_tokens=8)
    hidden = ref.step(tokens).main_hidden                     # [len(tokens), 3*dim]
    same = 0
    for anchor, p, drafts, conf in seen:     # bf16 chunk-vs-whole numerics: exact ids mostly, close logits
        assert anchor == tokens[p + 1]
        ref.dspark_absorb(hidden[:p + 1], torch.arange(p + 1))
        d = ref.dspark_propose(anchor, p)
        assert d.draft_ids[0, 0].item() == drafts[0], p
        same += d.draft_ids[0].tolist() == drafts
        assert torch.allclose(d.confidence[0].float(), torch.tensor(conf), atol=0.2), (p, d.confidence, conf)
    assert same >= 0.8 * len(seen)


def test_scheduler_policy_profiles_at_start_and_keeps_tokens(spec_args, plain):
    """The default policy: a step-time profile through the engine's own steps at start (its
    requests gone, its counters not counted), then the batch budget; greedy tokens stay identical."""
    engine = Engine(EngineArgs(**spec_args, speculative="dspark"))
    m = engine.step_time_model
    assert m.batch_sizes == [1, 4, 8] and m.drafts_per_seq == [0, 5]
    assert all(t > 0 for row in m.seconds for t in row)
    assert engine.stats.snapshot()["counters"]["steps_total"] == 0
    assert not engine.scheduler.requests and engine.kv_cache.num_used_blocks == 0
    got, _ = run(engine, PROMPTS, [params(n) for n in MAX_TOKENS])
    assert got == plain[0]
    assert engine.stats.snapshot()["counters"]["spec_draft_tokens_proposed_total"] > 0


def test_scheduler_prices_padded_steps_on_the_graph_path(spec_args):
    """With captured (batch, L) steps padded to the longest request (cuda_graph_sizes with
    spec_packed_verify=False; on a CPU the same padded buffers run eagerly) the scheduler knows a
    verify step runs padded, so every plan is one cap L (each request min(L, its drafts)); without
    graphs, or with packed (varlen) verify graphs (the default), it splits a budget (ragged)."""
    from deepinfer.spec.budget import VerifyBudgetPolicy
    from deepinfer.spec.step_time import StepTimeModel
    args = {**spec_args, "speculative": "dspark", "spec_policy": "scheduler", "cuda_graph_sizes": (1, 2, 4, 8)}
    packed = Engine(EngineArgs(**args))
    assert packed.runner.graphs.keys.packed and packed.scheduler.draft_book.policy.padded is None
    packed.shutdown()
    args["spec_packed_verify"] = False
    engine = Engine(EngineArgs(**args))
    pol = engine.scheduler.draft_book.policy
    assert isinstance(pol, VerifyBudgetPolicy) and pol.padded is not None and pol.padded(4, 6)
    # a step time that grows with the drafts, so caps short of 5 pay for low survivals
    sizes = [1, 4]
    steep = StepTimeModel(sizes, list(range(6)), [[1.0 + 0.1 * n * x for x in range(6)] for n in sizes])
    seen = []

    class Recorded(VerifyBudgetPolicy):
        def assign(self, entries):
            counts = super().assign(entries)
            seen.append(([e.num_drafts for e in entries], counts))
            return counts

    engine.scheduler.draft_book.policy = Recorded(steep, budget_confidences="newest", padded=pol.padded)
    got, _ = run(engine, PROMPTS, [params(n) for n in MAX_TOKENS])
    assert all(len(t) == n for t, n in zip(got.values(), MAX_TOKENS))
    multi = [(k, c) for k, c in seen if len(k) > 1]
    assert multi and all(c == [min(max(c), kr) for kr in k] for k, c in multi)     # one cap per step
    assert any(max(c) < max(k) for k, c in multi)                                   # the cap did cut
    # the same policy unpadded splits by confidence: requests with the same drafts get different counts
    ragged_pol = VerifyBudgetPolicy(steep, budget_confidences="newest")
    from deepinfer.spec.policy import DraftEntry
    entries = [DraftEntry(5, [3.0] * 5), DraftEntry(5, [-1.0] * 5)]
    assert ragged_pol.assign(entries) != Recorded(steep, budget_confidences="newest", padded=pol.padded).assign(entries)
    ragged = Engine(EngineArgs(**{**args, "cuda_graph_sizes": None}))
    assert ragged.scheduler.draft_book.policy.padded is None


def test_sampled_acceptance_is_seeded_and_leaves_greedy_requests_alone(spec_args):
    """spec_acceptance="sampled": requests at temperature > 0 draft by sampling and verify with
    min(1, p/q) + residual, which draws other streams than plain decoding (other tokens, same
    distribution: tests/sample/test_rejection.py); a rerun gives the same tokens; a greedy request in
    the same batch keeps plain decoding's tokens."""
    # NOTE: the tiny model's logits are ~100 wide, so at temperature ~1 its samples are its argmax;
    # temperature 8 spreads them (top token ~0.2-0.8)
    plist = [SamplingParams(max_tokens=10, temperature=8.0, top_p=0.95, seed=s, ignore_eos=True) for s in (1, 2)]
    plist.append(params(10))
    prompts = PROMPTS[:2] + [PROMPTS[3]]
    want, _ = run(Engine(EngineArgs(**spec_args)), prompts, plist)
    kw = dict(speculative="dspark", spec_policy="threshold", spec_confidence_threshold=0.0, spec_acceptance="sampled")
    engine = Engine(EngineArgs(**spec_args, **kw))
    got, _ = run(engine, prompts, plist)
    again, _ = run(Engine(EngineArgs(**spec_args, **kw)), prompts, plist)
    assert got == again
    assert got["2"] == want["2"]
    assert got["0"] != want["0"] or got["1"] != want["1"]
    assert all(len(got[r]) == 10 for r in got)
    assert engine.stats.snapshot()["counters"]["spec_draft_tokens_verified_total"] > 0


def test_replayed_acceptance_through_the_engine(spec_args):
    """Benchmark mode: the engine verifies for real and accepts by the replayed outcomes (mean
    accepted length 3.5 of 5 under verify-all); blocks roll back and free as usual."""
    engine = Engine(EngineArgs(**spec_args, speculative="dspark", spec_policy="all", spec_replay_accepted_length=3.5))
    got, steps = run(engine, PROMPTS, [params(40) for _ in PROMPTS])
    assert all(len(t) == 40 for t in got.values())
    c = engine.stats.snapshot()["counters"]
    mean_len = 1 + c["spec_draft_tokens_accepted_total"] / c["spec_verify_steps_total"]
    assert 2.5 < mean_len < 4.5 and steps < 25


def test_speculative_args_are_checked(tiny_engine_args):
    with pytest.raises(ValueError):
        EngineArgs(**tiny_engine_args, speculative="eagle")
    with pytest.raises(ValueError, match="DSpark block"):
        Engine(EngineArgs(**tiny_engine_args, speculative="dspark", num_speculative_tokens=6))
    with pytest.raises(ValueError, match="DSpark draft blocks"):   # as a checkpoint without DSpark blocks reads
        Engine(EngineArgs(**tiny_engine_args, speculative="dspark", model_overrides={"dspark_block_size": 0}))
    for bad in (-0.1, 1.2):
        with pytest.raises(ValueError, match=r"spec_confidence_threshold must be in \[0, 1\]"):
            EngineArgs(**tiny_engine_args, speculative="dspark", spec_confidence_threshold=bad)
    for bad in (dict(spec_policy="fast"), dict(spec_acceptance="lossy"), dict(spec_budget_confidences="stale"),
                dict(spec_replay_accepted_length=6.0)):
        with pytest.raises(ValueError):
            EngineArgs(**tiny_engine_args, speculative="dspark", **bad)
    assert LLM(**tiny_engine_args, speculative="dspark").engine.runner.proposer.num_speculative_tokens == 5
