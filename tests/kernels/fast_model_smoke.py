"""Run under TRITON_INTERPRET=1 DEEPINFER_KERNELS=fast (CPU): the whole model with every fast op that
kernels/select.py dispatches to, through Triton's interpreter, against the same model on the torch
references. Catches what a per-op test at chosen shapes cannot: a model shape a kernel rejects (the
tiny fixture's hidden 32 once tripped hc_mixes_pre on the H200) or a dispatch that feeds a kernel
the wrong layout. Loose bound (measured 0.39-0.47 std on v41-tiny-bf16, 2026-12-05): the interpreter truncates
float->bf16 casts where a GPU rounds, a bias that adds up over the layers.

    python tests/kernels/fast_model_smoke.py CHECKPOINT_DIR
"""

import os
import sys

assert os.environ.get("TRITON_INTERPRET") == "1" and os.environ.get("DEEPINFER_KERNELS") == "fast"

import torch  # noqa: E402

from deepinfer.kernels import select  # noqa: E402
from deepinfer.model.loader import load_model  # noqa: E402
from deepinfer.model.simple import SequenceRunner  # noqa: E402


def run(model, prompt: list[int], steps: int) -> list[torch.Tensor]:
    r = SequenceRunner(model, max_len=len(prompt) + steps + 8)
    out = [r.step(prompt).logits[0]]
    for _ in range(steps):
        out.append(r.step([int(out[-1].argmax())]).logits[0])
    return out


def main(ckpt: str) -> None:
    torch.manual_seed(0)
    model = load_model(ckpt, progress=False)
    prompt = torch.randint(1000, 50000, (70,)).tolist()   # > 64: two attention blocks, compressed entries
    calls: dict[str, int] = {}
    wrapped = {}
    for name in ("act_quant", "fp4_quant", "sparse_attn", "hc_mixes_pre", "hc_post", "index_scores_paged", "index_scores_pool",
                 "fp8_linear", "grouped_fp8_linear_masked", "rms_norm", "rope", "index_topk", "candidate_blocks",
                 "engram_gate", "swiglu_quant", "pool_lists", "router_topk", "rms_norm_quant", "norm_rope_quant",
                 "rope_fp4_quant", "window_pool", "hc_pre_norm"):
        fn = getattr(select, name, None)
        if fn is None:
            continue

        def counted(*a, _fn=fn, _name=name, **k):
            calls[_name] = calls.get(_name, 0) + (1 if select.use_fast(a[0]) else 0)
            return _fn(*a, **k)
        wrapped[name] = counted
    import deepinfer.model.ops as ops
    for name, fn in wrapped.items():
        if hasattr(ops, name):
            setattr(ops, name, fn)
    fast = run(model, prompt, 3)
    model.args.index_k_packed = True          # the index keys as packed FP4 rows: the same bits on the fast path
    packed = run(model, prompt, 3)
    model.args.index_k_packed = False
    assert all(torch.equal(a, b) for a, b in zip(fast, packed)), "packed index keys moved the fast path's logits"
    select.KERNELS = "ref"
    ref = run(model, prompt, 3)
    print("fast calls per op:", calls)
    assert all(calls.get(n) for n in ("sparse_attn", "hc_post", "rms_norm", "rope", "index_topk", "candidate_blocks",
                                      "engram_gate", "norm_rope_quant", "rope_fp4_quant", "window_pool",
                                      "hc_pre_norm")), calls
    for i, (f, r) in enumerate(zip(fast, ref)):
        top = r.topk(512).indices
        err = ((f[top] - r[top]).abs().max() / r.std()).item()
        print(f"step {i}: err {err:.4f} (logit std units), top-1 {'same' if f.argmax() == r.argmax() else 'DIFF'}")
        assert err < 1.0, f"step {i}: fast path logits off by {err:.3f} std"


if __name__ == "__main__":
    main(sys.argv[1])
