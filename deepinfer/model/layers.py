"""Building blocks shared by the model files: linear layers in the release weight formats, RMSNorm,
rotary tables. Activations travel in bf16 as in the reference (whose default dtype is bf16)."""

from __future__ import annotations

import torch
from torch import nn

from . import ops

ACT = torch.bfloat16


def compute_dtype(device: torch.device | str) -> torch.dtype:
    """Dequantized weights are exact in bf16; on CPU fp32 matmuls are faster and give the same
    fp32-accumulated result, so the CPU keeps them in fp32."""
    return torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16


class Linear(nn.Module):
    """y = x @ W^T, bf16 out. `quantized` (FP8 / FP4 weights in the checkpoint): the input is first
    FP8-rounded per 32 (act_quant), as the release GEMMs do; the GEMM itself is an fp32-accumulated
    product of exactly dequantized values ("FP8/FP4 GEMMs as one fp32 matmul": noise-free).

    The weight lives in one of three forms (the loader picks, loader.load_model weight_format):
        weight   dense values in the compute dtype (bf16 checkpoints; weight_format="dense")
        fp8      (e4m3 [N, K], E8M0 bytes [N/32, K/32] per tile or [N, K/32] per row): the release
                 format, run by ops.fp8_linear (Triton W8A16 GEMM on a GPU, act_quant + the
                 dequantized matmul elsewhere: the dense form's bits); `weight` is then empty
        packed   FP4 (codes, E8M0 scales) of a routed expert, dequantized per use
    fp8_decode (beside a compute-dtype `weight`, EngineArgs.dense_weights="bf16+fp8"): the release's FP8
    bytes kept for decode-sized calls, which the CUDA FP8 x FP8 decode GEMM reads at half the bf16 bytes
    (ops.fp8_decode_takes says which calls); the same values either way"""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.empty(out_features, in_features), persistent=False)
        self.quantized = False
        self.fp8: tuple[torch.Tensor, torch.Tensor] | None = None      # FP8 (e4m3 weight, E8M0 scales)
        self.packed: tuple[torch.Tensor, torch.Tensor] | None = None   # FP4 (codes, E8M0 scales) kept packed
        self.packed_kernel_layout = False      # packed codes in fp4_layout.fp4_kernel_layout (FP4 expert stacks)
        # a block-diagonal weight's FP8 blocks (e4m3 [G, N/G, K], E8M0 [G, N/G/32, K/32], or one scale per
        # row [G, N/G, K/32] where N/G % 32 != 0: loader.wo_a_blocks): wo_a, run by ops.grouped_w8a16
        # with no activation rounding (Attention.out)
        self.fp8_blocks: tuple[torch.Tensor, torch.Tensor] | None = None
        self.fp8_decode: tuple[torch.Tensor, torch.Tensor] | None = None   # FP8 copy of a bf16-held weight

    def dense(self) -> torch.Tensor:
        """The exact weight values; FP8 / packed FP4 weights are dequantized on the fly (bounded memory)."""
        if self.fp8 is not None:
            return ops.dequant_fp8(*self.fp8).to(compute_dtype(self.fp8[0].device))
        if self.packed is None:
            return self.weight
        codes, scale = self.packed
        if self.packed_kernel_layout:
            from deepinfer.kernels.fp4_layout import fp4_release_layout
            codes = fp4_release_layout(codes)
        return ops.dequant_fp4(codes, scale).to(compute_dtype(codes.device))

    def forward(self, x: torch.Tensor, rounded: bool = False) -> torch.Tensor:
        """rounded: x is act_quant's output already (a fused SwiGLU + quant): act_quant would return it
        unchanged (it is idempotent), so the dense path skips that launch."""
        if self.fp8 is not None:
            return ops.fp8_linear(x, *self.fp8)
        if self.fp8_decode is not None and ops.fp8_decode_takes(x, *self.fp8_decode):
            return ops.fp8_decode_linear(x, *self.fp8_decode)
        if self.quantized and not rounded:
            x = ops.act_quant(x)
        w = self.dense()
        return ops.dense_linear(x.to(w.dtype), w).to(ACT)

    def rounds_input(self, x: torch.Tensor) -> bool:
        """forward(x) would run act_quant on x itself (a quantized weight on the dense path, the FP8 decode
        GEMM not taking x): then a norm before it can hand over its rounded rows (RMSNorm.with_rounded)."""
        if not self.quantized or self.fp8 is not None:
            return False
        return self.fp8_decode is None or not ops.fp8_decode_takes(x, *self.fp8_decode)

    def forward_fp32(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 out of an fp32 product (the ratio>1 compressor promotes its weights to fp32)."""
        return linear_fp32(x, self.dense())


def linear_fp32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w^T in fp32 arithmetic, fp32 out. On CUDA with bf16 operands a bf16 GEMM with fp32
    accumulation and output: bf16 products are exact in fp32, so it is the fp32 GEMM's math without
    an fp32 copy of the weight per call (the head's would be 2.6 GB at full width). Decode-sized
    calls with a narrow w (router, compressor) run a split-K Triton GEMM, the rest cuBLAS; a CPU
    runs the fp32 matmul (ops.linear_fp32, kernels/select.py)."""
    return ops.linear_fp32(x, w)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.register_buffer("weight", torch.ones(dim), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)

    def with_rounded(self, x: torch.Tensor, *consumers: Linear | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(self(x), act_quant of it or None): the rounded rows from the same launch where one of the
        consumers would round its input itself (Linear.rounds_input); pass them as forward(xq, rounded=True).
        Any consumer may take them: act_quant is idempotent, so a path that rounds again gets the same values."""
        if any(c is not None and c.rounds_input(x) for c in consumers):
            return ops.rms_norm_quant(x, self.weight, self.eps)
        return self(x), None


class RopeTable:
    """Rotary rows for one layer kind, grown on demand (rows do not depend on the table length)."""

    def __init__(self, dim: int, original_seq_len: int, base: float, factor: float, beta_fast: float,
                 beta_slow: float):
        self.params = (dim, original_seq_len, base, factor, beta_fast, beta_slow)
        self.table: torch.Tensor | None = None

    def __call__(self, positions: torch.Tensor, max_pos: int | None = None) -> torch.Tensor:
        """max_pos: the largest position if the caller knows it (no device-to-host read)."""
        if max_pos is None:
            max_pos = int(positions.max()) if positions.numel() else 0
        need = max_pos + 1
        if self.table is None or self.table.shape[0] < need or self.table.device != positions.device:
            n = max(4096, 1 << (need - 1).bit_length())
            dim, orig, base, factor, bf, bs = self.params
            self.table = ops.rope_freqs(dim, n, orig, base, factor, bf, bs, device=positions.device)
        return self.table[positions]


def rope_tables(args) -> dict[str, RopeTable]:
    """'local': rope_theta, no YaRN (ratio-0 layers, DSpark); 'yarn': compress_rope_theta with YaRN
    (every layer with compress ratio > 0: q, window KV, compressed KV, indexer q and k alike)."""
    return {
        "local": RopeTable(args.rope_head_dim, 0, args.rope_theta, args.rope_factor, args.beta_fast, args.beta_slow),
        "yarn": RopeTable(args.rope_head_dim, args.original_seq_len, args.compress_rope_theta, args.rope_factor,
                          args.beta_fast, args.beta_slow),
    }


class Embedding(nn.Module):
    def __init__(self, num: int, dim: int):
        super().__init__()
        self.register_buffer("weight", torch.empty(num, dim, dtype=ACT), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.embedding(ids, self.weight)
