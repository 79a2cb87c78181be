"""How far the DEEPINFER_GEMM=deepgemm mode moves a random-weight model's decode logits from the
exact Triton path, next to what merely reordering fp32 sums (the torch reference vs Triton) does:
the small preset, a 24-token prefill, then 12 tokens each decoded from that state. Prints each
configuration's per-token err (check-parity's: max over the top-512 logits / logit std) and median.

    python perf/deepgemm_drift.py [--checkpoint DIR]      (CUDA, SM90, DeepGEMM importable)
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests", "kernels"))

from test_deepgemm_backend import decode_errors  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint")
    a = p.parse_args()
    from deepinfer.kernels import deepgemm, select
    from deepinfer.model.loader import load_model
    ckpt = a.checkpoint
    if ckpt is None:
        ckpt = os.path.join(tempfile.gettempdir(), "deepinfer-small")
        if not os.path.isfile(os.path.join(ckpt, "config.json")):
            subprocess.run([sys.executable, "-m", "deepinfer.cli.make_checkpoint", "--preset", "small", "--out", ckpt],
                           check=True, capture_output=True)
    torch.manual_seed(0)
    prompt = torch.randint(1000, 50000, (24,)).tolist()
    toks = torch.randint(1000, 50000, (12,)).tolist()

    def run(label, fuse, switch):
        select.GEMM = "triton"
        select.KERNELS = "fast"
        select._fast_ok.cache_clear()
        model = load_model(ckpt, device="cuda", progress=False, weight_format="fp8", fuse_linears=fuse)
        errs = decode_errors(model, prompt, toks, lambda: switch(model))
        print(f"{label:<44} median {statistics.median(errs):.4f}  max {max(errs):.4f}  "
              f"{[round(e, 3) for e in errs]}", flush=True)

    def to_ref(model):
        select.KERNELS = "ref"
        select._fast_ok.cache_clear()

    def to_deepgemm(model):
        select.GEMM = "deepgemm"
        deepgemm.prepare_deepgemm(model)

    run("torch reference vs Triton (yardstick)", None, to_ref)
    run("DeepGEMM vs Triton, fused input linears", None, to_deepgemm)
    run("DeepGEMM vs Triton, linears apart", False, to_deepgemm)


if __name__ == "__main__":
    main()
