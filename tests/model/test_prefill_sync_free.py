"""A prefill forward on CUDA never makes the host wait for the device (GPU).

Each synchronizing call (a device value read on the host, a copy from pageable host memory) drains the
launch queue: the GPU idles while the host issues what follows, and asynchronous scheduling cannot
prepare the next step during this one. H200, 2026-12-03: the Engram hasher's three pageable copies were
the only ones in a 40-layer 1 x 8k prefill (perf/bench_model_prefill.py --profile, "synchronizing calls").
"""

import os
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "perf"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_prefill_forward_makes_no_synchronizing_call():
    from benchutil import dummy_model
    from deepinfer.cache.model_caches import ModelCaches
    from deepinfer.model.simple import make_batch
    model = dummy_model("small", dense_weights="bf16")
    assert model.args.engram_layer_ids, "the preset should exercise the Engram hasher"
    nb = 8
    caches = ModelCaches.allocate(model.args, 2, 2 * nb, 64, "cuda")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 20000, (400,), generator=g).tolist()
    ngram, table = model.args.engram_max_ngram_size, torch.arange(2 * nb).view(2, nb)
    first = make_batch([(ids[:300], 0, []), (ids[:100], 0, [])], [0, 1], table, ngram, "cuda")
    # both continue on what the first step cached (n-gram history from the earlier tokens)
    cont = make_batch([(ids[300:350], 300, ids[:300]), (ids[100:200], 100, ids[:100])], [0, 1], table, ngram, "cuda")
    model(first, caches)
    model(cont, caches)                                    # kernels compiled, lazy state built
    torch.cuda.synchronize()
    for batch in (first, cont):                            # rewrites the same cache rows with the same values
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = model(batch, caches)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        assert torch.isfinite(out.logits).all()
