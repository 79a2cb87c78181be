"""16 requests of mixed lengths through the engine at once (chunked prefill mixed with decode),
teacher-forced on the fixture's fed tokens; the recorded logits must pass check-parity."""

import json
import subprocess
import sys

import numpy as np
import pytest

from deepinfer.config import EngineArgs
from deepinfer.engine import Engine
from deepinfer.sampling_params import SamplingParams
from tests.conftest import SHARED, build_fixture

COPIES = 4  # 4 prompts x 4 copies = 16 requests


def run_teacher_forced(engine: Engine, expected) -> dict[str, np.ndarray]:
    """Staggered arrivals so prompt chunks of later copies share steps with decodes of earlier ones."""
    logits: dict[str, list] = {}
    pending = [(f"c{c}-p{i}", i) for c in range(COPIES) for i in range(4)]
    steps_mixed = 0
    while pending or engine.has_unfinished_requests():
        for _ in range(4 if pending else 0):
            rid, i = pending.pop(0)
            engine.add_request(rid, expected[f"p{i}_prompt_ids"].tolist(),
                               SamplingParams(max_tokens=17, temperature=0, ignore_eos=True),
                               forced_token_ids=expected[f"p{i}_fed_tokens"].tolist(), return_logits=True)
            logits[rid] = []
        sched_out = engine.scheduler.schedule()
        runner_out = engine.runner.execute(sched_out)
        outs = engine.scheduler.update_from_output(sched_out, runner_out)
        n = sched_out.num_scheduled_tokens
        steps_mixed += int(any(v == 1 for v in n.values()) and any(v > 1 for v in n.values()))
        for o in outs:
            if o.logits is not None:
                logits[o.request_id].append(o.logits)
            if o.finished:
                assert o.finish_reason == "length", o
    assert steps_mixed > 0, "no step mixed prefill chunks with decodes"
    return {rid: np.concatenate(rows) for rid, rows in logits.items()}


@pytest.mark.parametrize("fixture_name", ["v41-tiny-bf16", "v41-tiny"])
def test_sixteen_mixed_requests_pass_check_parity(fixture_name, tmp_path, tmp_path_factory):
    ckpt = build_fixture(fixture_name, tmp_path_factory)
    expected = np.load(ckpt / "expected.npz")
    engine = Engine(EngineArgs(checkpoint=str(ckpt), device="cpu", max_num_seqs=16,
                               max_num_batched_tokens=192, block_tokens=64, num_cache_blocks=16 * 13,
                               model_overrides={"emulate_index_k_alias": True}))
    logits = run_teacher_forced(engine, expected)
    assert engine.kv_cache.num_used_blocks == 0
    check_copies(logits, expected, ckpt, tmp_path, "16 requests, chunked prefill + decode")


def check_copies(logits: dict[str, np.ndarray], expected, ckpt, tmp_path, batch: str) -> None:
    """Each copy's 4 requests as one candidate file; check-parity must pass every copy."""
    for c in range(COPIES):
        cand = {"meta_json": np.array(json.dumps({"format": "dsv41-parity-candidate/1", "engine": "deepinfer",
                                                  "batch": batch}))}
        for i in range(4):
            lg = logits[f"c{c}-p{i}"]
            assert lg.shape[0] == 17
            cand[f"p{i}_prefill_logits"] = lg[0].astype(np.float32)
            cand[f"p{i}_decode_logits"] = lg[1:17].astype(np.float32)
            cand[f"p{i}_fed_tokens"] = expected[f"p{i}_fed_tokens"]
            cand[f"p{i}_prompt_ids"] = expected[f"p{i}_prompt_ids"]
            cand[f"p{i}_tokens"] = lg.argmax(-1).astype(np.int64)
        path = tmp_path / f"candidate-copy{c}.npz"
        np.savez(path, **cand)
        res = subprocess.run([sys.executable, str(SHARED / "tools" / "check-parity"), str(ckpt), str(path)],
                             capture_output=True, text=True)
        verdict = res.stdout.strip().splitlines()[-1] if res.stdout.strip() else res.stderr[-2000:]
        print(f"copy {c}: {verdict}")
        assert res.returncode == 0, f"copy {c}: {verdict}\n{res.stdout[-3000:]}"
