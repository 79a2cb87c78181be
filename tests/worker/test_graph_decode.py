"""The static (CUDA-graph) form of a decode step computes what the dynamic form computes.

1. model level (CPU): prompts of 5, 130 and 260 tokens prefilled, then 40 one-token steps (crossing
   ratio-2 group boundaries and the 128-token window), once with StepMetadata built per step and
   once through DecodeStepBuffers padded to batch 4: logits and caches bitwise equal (the GEMMs
   row by row, so padding rows cannot change the real rows' bits; unpadded also without that).
2. engine level (CPU): graphs "enabled" in eager-padded mode (CudaGraphRunner without CUDA runs the
   step function on the padded static buffers) gives the plain engine's tokens and logits.
3. GPU (marked): CUDA graphs on vs enforce_eager, equal tokens, and graphs were replayed; padded
   replays bitwise equal to the same padded step run eagerly.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deepinfer.cache.model_caches import ModelCaches
from deepinfer.kernels.batch_invariant import batch_invariant_mode
from deepinfer.model.simple import make_batch
from deepinfer.model.step_metadata import DecodeStepBuffers

from cache_views import owned_cache_tensors

pytestmark = pytest.mark.usefixtures("one_thread")

BT, MAX_LEN, SLOTS = 64, 512, 3


def _tables(n_seqs: int, per_seq: int) -> np.ndarray:
    """Interleaved blocks: sequence i owns blocks i, i + n, i + 2n, ..."""
    return np.arange(n_seqs * per_seq).reshape(per_seq, n_seqs).T.copy()


def _hist(seq: list[int], ngram: int) -> list[int]:
    h = seq[-(ngram - 1):] if ngram > 1 else []
    return [-1] * (ngram - 1 - len(h)) + list(h)


def _run(model, prompts, steps: int, static_batch: int | None, invariant: bool):
    """Prefill every prompt (one dynamic step), then `steps` one-token steps with fixed random tokens,
    dynamic (static_batch None) or through DecodeStepBuffers of that size. -> (logits per step, caches)."""
    args = model.args
    ngram = args.engram_max_ngram_size
    new_tokens = np.random.default_rng(1).integers(3, args.vocab_size, size=(steps, len(prompts))).tolist()
    per_seq = -(-(MAX_LEN + 16) // BT)
    tables = _tables(len(prompts), per_seq)
    caches = ModelCaches.allocate(args, SLOTS, len(prompts) * per_seq, BT, scratch=True)
    slots = list(range(len(prompts)))
    seqs = [list(p) for p in prompts]
    model(make_batch([(s, 0, []) for s in seqs], slots, torch.from_numpy(tables), ngram, "cpu"), caches)
    bufs = None
    if static_batch is not None:
        bufs = DecodeStepBuffers(static_batch, window=args.window_size, ring_len=caches.ring_len,
                                 max_model_len=MAX_LEN, block_tokens=BT, max_blocks=per_seq + 2,
                                 ngram_width=ngram - 1, ratios=caches.ratios.values(),
                                 scratch_slot=caches.scratch_slot, scratch_block=caches.scratch_block)
    logits = []
    # padded: row-by-row GEMMs, since on a CPU padding rows change the blocking (last bits) of the
    # real rows' products; the metadata, not the batch size, is what is compared
    with batch_invariant_mode(invariant):
        for toks in new_tokens:
            if bufs is None:
                batch = make_batch([([t], len(s), s) for t, s in zip(toks, seqs)], slots,
                                   torch.from_numpy(tables), ngram, "cpu")
                out = model(batch, caches).logits
            else:
                bufs.fill(bufs.flat.numpy(), positions=[len(s) for s in seqs], input_ids=toks,
                          ngram_history=np.array([_hist(s, ngram) for s in seqs]), ring_slots=slots,
                          block_tables=tables)
                out = model(bufs.forward_batch(), caches, meta=bufs.metadata(MAX_LEN + 63)).logits[:len(seqs)]
            logits.append(out.clone())
            for s, t in zip(seqs, toks):
                s.append(t)
    return logits, caches


@pytest.mark.parametrize("lens,steps,static_batch", [((5, 130, 260), 40, 4), ((5, 9), 24, 4), ((5, 130, 260), 40, 3)])
def test_static_decode_metadata_matches_dynamic(tiny_model, lens, steps, static_batch):
    """(5, 130, 260): the window (128) and ratio-2 groups crossed; the static E (MAX_LEN // ratio)
    is wider than the dynamic one. (5, 9): E below index_topk and the dynamic ring narrower than
    window - 1, so the static lists are wider (trailing -1s) than the dynamic ones. Padded to 4
    under batch-invariant GEMMs; unpadded (3) with the default GEMMs: bitwise either way."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, tiny_model.args.vocab_size, size=n).tolist() for n in lens]
    invariant = static_batch > len(lens)
    dyn, dyn_caches = _run(tiny_model, prompts, steps, None, invariant)
    sta, sta_caches = _run(tiny_model, prompts, steps, static_batch, invariant)
    for step, (a, b) in enumerate(zip(dyn, sta)):
        assert torch.equal(a, b), (step, (a - b).abs().max().item())
    for (name, a), (_, b) in zip(owned_cache_tensors(dyn_caches), owned_cache_tensors(sta_caches)):
        assert torch.equal(a, b), name


# ---- the engine ---------------------------------------------------------------------------------
def _llm(ckpt, device: str = "cpu", **kw):
    from deepinfer import LLM
    return LLM(str(ckpt), **{**dict(device=device, max_num_seqs=8, max_num_batched_tokens=128, block_tokens=8,
                                    num_cache_blocks=128, max_model_len=256), **kw})


def test_graph_sizes():
    from types import SimpleNamespace

    from deepinfer.config import EngineArgs
    from deepinfer.worker.graph_step import graph_sizes
    margs = SimpleNamespace(emulate_index_k_alias=False)
    assert graph_sizes(EngineArgs(max_num_seqs=64), margs, "cuda") == (1, 2, 4, 8, 16, 32, 64)
    assert graph_sizes(EngineArgs(max_num_seqs=5), margs, "cuda:0") == (1, 2, 4, 8)
    assert graph_sizes(EngineArgs(), margs, "cpu") == ()
    assert graph_sizes(EngineArgs(cuda_graph_sizes=[3, 1]), margs, "cpu") == (1, 3)
    for off in (dict(enforce_eager=True), dict(batch_invariant=True)):
        assert graph_sizes(EngineArgs(**off), margs, "cuda") == ()
    # DSpark verify steps have graphs too (tests/worker/test_graph_verify.py)
    assert graph_sizes(EngineArgs(speculative="dspark", max_num_seqs=8), margs, "cuda") == (1, 2, 4, 8)
    assert graph_sizes(EngineArgs(), SimpleNamespace(emulate_index_k_alias=True), "cuda") == ()


def _engine_run(ckpt, invariant: bool, **kw):
    """4 requests (greedy and seeded sampling, a 1-token prompt whose first step is a prefill, so
    eager) finishing at different steps: decode batches of 4, 3, 2, 1."""
    from deepinfer import SamplingParams
    prompts = [list(range(3, 8)), list(range(100, 140)), list(range(200, 350)), [9]]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (30, 12, 24)]
    params.append(SamplingParams(max_tokens=10, temperature=0.8, seed=3, ignore_eos=True))
    llm = _llm(ckpt, **kw)
    with batch_invariant_mode(invariant):
        return llm, llm.generate(prompts, params, return_logits=True)


@pytest.fixture(scope="module")
def eager_engine_outputs(tiny_checkpoint):
    cache = {}

    def get(invariant: bool):
        if invariant not in cache:
            cache[invariant] = _engine_run(tiny_checkpoint, invariant, async_scheduling=False)[1]
        return cache[invariant]
    return get


@pytest.mark.parametrize("sizes,invariant,async_scheduling,max_len", [
    ((1, 2, 4, 8), True, False, 8192), ((1, 2, 4, 8), True, True, 8192), ((1, 2, 3, 4), False, True, 8192),
    ((1, 2, 4, 8), True, True, 160)])
def test_engine_graph_path_matches_eager_cpu(tiny_checkpoint, eager_engine_outputs, sizes, invariant,
                                             async_scheduling, max_len):
    """The runner's graph path with CudaGraphRunner in eager mode (no CUDA): the padded static step
    (3 requests padded to 4), sync and async scheduling (device-side pending tokens patched into the
    static input ids), the sampler path. Tokens and logits bitwise equal to the plain engine's:
    padded under row-by-row GEMMs (a padding row changes the CPU GEMM blocking of the real rows,
    which can flip an expert or index pick and with it a token, as any other batch composition
    does); with one size per batch (no padding) also with the default GEMMs. max_len 160: once the
    150-token prompt's sequence reaches position 160 its steps run eagerly (max_seq_len_to_capture)."""
    ref = eager_engine_outputs(invariant)
    llm, got = _engine_run(tiny_checkpoint, invariant, async_scheduling=async_scheduling, cuda_graph_sizes=sizes,
                           max_seq_len_to_capture=max_len)
    for g, r in zip(got, ref):
        assert g.token_ids == r.token_ids
        assert np.array_equal(g.logits, r.logits)
    graphs = llm.engine.runner.graphs
    assert graphs is not None and graphs.num_replays == 0
    # 28 of the 30 steps are pure decode steps; with max_len 160, about half of them run eagerly
    assert (graphs.num_steps >= 25) if max_len > 256 else (5 < graphs.num_steps < 20), graphs.num_steps


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_cuda_graphs_match_eager_gpu(tiny_checkpoint, batch, monkeypatch):
    """32 greedy decode steps on CUDA (the requests finish at different steps: decode batches from
    `batch` down to 1):
    1. graphs with one size per batch (1..8, no padding) give enforce_eager's tokens;
    2. graphs with sizes 1, 2, 4, 8 (padding) give exactly (tokens and logits bitwise) what the
       same padded step run eagerly gives: capture, replay, static refill, pending-token patch.
    Padded graphs are not compared with enforce_eager token for token: a padding row may change a
    GEMM's kernel for the real rows (last bits), and on random weights that can flip an expert or
    an index pick, as any other batch composition can."""
    from deepinfer import SamplingParams
    from deepinfer.worker import graph_step
    prompts = [list(range(10 + 7 * i, 15 + 44 * i)) for i in range(batch)]      # 5 .. 264 tokens
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    kw = dict(device="cuda", block_tokens=16, num_cache_blocks=512, max_model_len=1024)

    def run(**more):
        llm = _llm(tiny_checkpoint, **kw, **more)
        return llm.generate(prompts, params, return_logits=True), llm.engine.runner.graphs

    ref, none = run(enforce_eager=True)
    assert none is None
    exact, graphs = run(cuda_graph_sizes=tuple(range(1, 9)))
    assert graphs is not None and graphs.num_replays > 0, "no CUDA graph replayed (capture failed? see the log)"
    for i, (g, r) in enumerate(zip(exact, ref)):
        if g.token_ids != r.token_ids:
            k = next(j for j, (a, b) in enumerate(zip(g.token_ids, r.token_ids)) if a != b)
            top2 = np.sort(r.logits[k])[-2:]
            raise AssertionError(f"sequence {i}: token {k} differs ({g.token_ids[k]} vs eager {r.token_ids[k]}); "
                                 f"eager top-2 gap {top2[1] - top2[0]:.3g}, max |logit diff| at that step "
                                 f"{np.abs(g.logits[k] - r.logits[k]).max():.3g}")

    padded, graphs = run(cuda_graph_sizes=(1, 2, 4, 8))
    assert graphs.num_replays > 0

    class EagerPadded(graph_step.CudaGraphRunner):
        def __init__(self, fn, sizes, enabled=None, **kw):
            super().__init__(fn, sizes, enabled=False, **kw)
    with monkeypatch.context() as m:
        m.setattr(graph_step, "CudaGraphRunner", EagerPadded)
        same, graphs = run(cuda_graph_sizes=(1, 2, 4, 8))
    assert graphs.num_steps > 0 and graphs.num_replays == 0
    for g, s in zip(padded, same):
        assert g.token_ids == s.token_ids
        assert np.array_equal(g.logits, s.logits)
