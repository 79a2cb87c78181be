"""Three calls of the CUDA FP8 decode GEMM on wq_b (32768 x 1280) at 1 and 64 tokens, for Nsight Compute:
    ncu --kernel-name regex:fp8_decode --launch-skip 2 --launch-count 1 --section SpeedOfLight ... python3 perf/ncu_decode_probe.py
(perf/round21.steps; --launch-skip 5 for the 64-token call)."""
import torch, sys
sys.path.insert(0, '.')
from deepinfer.kernels.cuda_fp8_decode import fp8_decode_linear
n, k = 32768, 1280
w = (torch.randn(n, k, device="cuda") * k ** -0.5).to(torch.float8_e4m3fn)
s = torch.randint(118, 124, (n // 32, k // 32), dtype=torch.uint8, device="cuda")
for m in (1, 64):
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        fp8_decode_linear(x, w, s)
torch.cuda.synchronize()
