"""Prefill/decode disaggregation with images (the tiny preset's vision tower, CPU, NIXL over UCX): the
prefill instance encodes and runs the prompt, the decode instance pulls the caches and goes on without
running its tower, and under batch_invariant the tokens equal a single instance's, with an image in the
middle of the prompt and one ending it (the decode's first Engram look-back reads dead span positions),
in both pull modes (the replay mode falls back to the window where the replay would cover a span; where it
replays from past position 0, as for the 200-token prompt, it is approximate by design: the prefill's token and
the length match and the first decode step's logits are close; its greedy tokens once matched by luck of the
tiny model's last bits)."""

from __future__ import annotations

import pytest

from deepinfer.disagg.nixl_transport import import_nixl

try:
    import_nixl()
except ImportError as e:
    pytest.skip(str(e), allow_module_level=True)

import torch  # noqa: E402

from deepinfer.config import EngineArgs  # noqa: E402
from deepinfer.disagg.process import EngineProcess  # noqa: E402
from deepinfer.engine import Engine  # noqa: E402
from deepinfer.sampling_params import SamplingParams  # noqa: E402
from tests.engine.test_engine_images import IMG, png  # noqa: E402

PARAMS = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
# the span ends the prompt; the span mid-prompt; the span early in a prompt whose replay (window=False:
# from H - 128 with H = 192) starts past it
REQUESTS = {"end": ([3, 4, 5, IMG], [png(60, 90, 2)]),
            "mid": ([5, 6, IMG, 7, 8, 9], [png(90, 60, 1)]),
            "early": ([1, IMG] + [(7 * i) % 900 + 10 for i in range(200)], [png(64, 64, 3)])}


def engine_args(ckpt, **kw) -> dict:
    return dict(checkpoint=str(ckpt), device="cpu", max_num_seqs=4, max_num_batched_tokens=256, block_tokens=64,
                num_cache_blocks=32, batch_invariant=True, **kw)


@pytest.fixture(scope="module")
def single(tiny_checkpoint):
    """rid -> (tokens, logits of each step) on one kv_role="both" instance."""
    engine = Engine(EngineArgs(**engine_args(tiny_checkpoint)))
    out = {}
    for rid, (prompt, images) in REQUESTS.items():
        engine.add_request(rid, prompt, PARAMS, images=images, return_logits=True)
        toks, logits = [], []
        while engine.has_unfinished_requests():
            for o in engine.step():
                toks += o.new_token_ids
                logits += [] if o.logits is None else [torch.as_tensor(o.logits).float().flatten()]
        out[rid] = (toks, logits)
    return out


@pytest.mark.parametrize("window", [True, False])
def test_handover_with_images_gives_a_single_instances_tokens(tiny_checkpoint, single, window):
    prefill = EngineProcess(engine_args(tiny_checkpoint, kv_role="prefill"), num_threads=1, name="prefill")
    decode = EngineProcess(engine_args(tiny_checkpoint, kv_role="decode", kv_transfer_window=window),
                           num_threads=1, name="decode")
    try:
        for rid, (prompt, images) in REQUESTS.items():
            first = list(prefill.stream(rid, prompt, PARAMS, images=images))
            kv = first[-1].kv_transfer_params
            assert kv is not None and kv["num_tokens"] == first[-1].num_prompt_tokens > len(prompt)
            outs = list(decode.stream(rid, prompt, PARAMS, images=images, kv_transfer_params=kv, return_logits=True))
            assert outs[-1].finish_reason == "length", outs[-1]
            got = sum((o.new_token_ids for o in outs), [])
            want, want_logits = single[rid]
            # the replay mode is exact where it replays from position 0; past that its window is rebuilt from
            # [H - 128, n] alone, approximate by design (config.kv_transfer_window; test_handover.py judges it by
            # the fixture's rule): there the prefill's token and the length are a single instance's, and the
            # first decode step (the same input token) gives close logits (measured 2026-12-07: median 0.027
            # std, max 1.2 std; a step on another token is ~0.5 / ~20)
            H = kv["num_tokens"] // 64 * 64
            if window or H - min(128, H) == 0:
                assert got == want, rid
            else:
                assert len(got) == len(want) and got[0] == want[0], rid
                a = torch.as_tensor(next(o.logits for o in outs if o.logits is not None)).float().flatten()
                b = want_logits[1]                              # [0]: the prefill's step
                err = (a - b).abs() / b.std()
                assert err.median() < 0.1 and err.max() < 4, (rid, err.median().item(), err.max().item())
        pstate, dstate = prefill.state(), decode.state()
        assert pstate["images_encoded"] == 3 and dstate["images_encoded"] == 0
        replayed = dstate["stats"]["counters"].get("kv_transfer_replayed_tokens_total", 0)
        assert (replayed > 0) == (not window)        # only "early" replays: its span lies before the replay
        assert dstate["requests"] == 0 and dstate["cache_blocks_used"] == 0
    finally:
        prefill.close()
        decode.close()
