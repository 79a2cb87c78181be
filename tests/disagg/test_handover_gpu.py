"""The hand-over with the caches in GPU memory (NIXL's UCX moves VRAM to VRAM: CUDA IPC on one host,
RDMA across hosts): two engine processes on one GPU, greedy tokens and logits equal a single
instance's under batch_invariant, for the small preset (full-width layers) and the fixture."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from deepinfer.config import EngineArgs  # noqa: E402
from deepinfer.disagg.nixl_transport import import_nixl  # noqa: E402
from deepinfer.disagg.process import EngineProcess  # noqa: E402
from deepinfer.engine import Engine  # noqa: E402
from deepinfer.sampling_params import SamplingParams  # noqa: E402
from tests.disagg.test_handover import assert_nothing_held  # noqa: E402

try:
    import_nixl()
except ImportError as e:
    pytest.skip(str(e), allow_module_level=True)


def args(ckpt, **kw):
    return dict(checkpoint=str(ckpt), device="cuda", max_num_seqs=8, max_num_batched_tokens=2048, block_tokens=64,
                num_cache_blocks=256, batch_invariant=True, enforce_eager=True, **kw)


@pytest.mark.parametrize("which", ["small", "fixture"])
def test_handover_in_gpu_memory_equals_a_single_instance(which, small_checkpoint, fixture_checkpoint):
    ckpt = small_checkpoint if which == "small" else fixture_checkpoint
    rng = np.random.default_rng(0)
    prompts = {f"g{i}": rng.integers(100, 20000, size=n).tolist() for i, n in enumerate((17, 300, 1000))}
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    engine = Engine(EngineArgs(**args(ckpt)))
    ref, ref_logits = {rid: [] for rid in prompts}, {rid: [] for rid in prompts}
    # one prompt at a time, as the pair runs them: batch invariance on CUDA does not hold with long
    # prompts prefilled together (README, "What does not work yet"), and this test is of the hand-over
    for rid, p in prompts.items():
        engine.add_request(rid, p, params, return_logits=True)
        while engine.has_unfinished_requests():
            for o in engine.step():
                ref[o.request_id] += o.new_token_ids
                if o.logits is not None:   # a step that samples nothing (a prefill chunk) has none
                    ref_logits[o.request_id].append(o.logits)
    del engine
    torch.cuda.empty_cache()
    prefill = EngineProcess(args(ckpt, kv_role="prefill"), name="prefill")
    decode = EngineProcess(args(ckpt, kv_role="decode"), name="decode")
    try:
        for rid, p in prompts.items():
            first = list(prefill.stream(rid, p, params, return_logits=True))[-1]
            outs = list(decode.stream(rid, p, params, return_logits=True, kv_transfer_params=first.kv_transfer_params))
            toks = [t for o in outs for t in o.new_token_ids]
            assert toks == ref[rid], rid
            lg = np.concatenate([first.logits] + [o.logits for o in outs if o.logits is not None])
            np.testing.assert_array_equal(lg, np.concatenate(ref_logits[rid]))
            print(f"{rid}: {len(p)} prompt tokens, {first.kv_transfer_params['num_bytes']} bytes pulled")
        d = decode.state()
        print("decode counters:", {k: v for k, v in d["stats"]["counters"].items() if k.startswith("kv_")})
        assert d["stats"]["counters"]["kv_transfers_total"] == len(prompts)
        assert_nothing_held(prefill, decode)   # polled: the prefill frees on the decode's notification
    finally:
        prefill.close()
        decode.close()
