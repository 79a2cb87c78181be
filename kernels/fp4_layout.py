"""MXFP4 weights in the W4A16 kernels' layout (plain torch: a CPU load needs no Triton).

    fp4_kernel_weight(packed, scale)   a release MXFP4 weight -> (bytes in fp4_kernel_layout, scale bytes
                                       with byte 0 mapped away): what triton_gemm.w4a16_* and
                                       triton_dequant.dequant_fp4_bf16 read; once per weight, at load
    fp4_kernel_layout / fp4_release_layout   the nibble permutation and its inverse
    fp4_scales_ok(scale)               whether the kernels' decode holds for a weight's block scales

Why the layout: the bf16 wgmma A fragment gives a thread, per row and k16 slice, the k pairs (2c, 2c+1)
and (2c+8, 2c+9), c = lane % 4; in the release layout (element 2i in byte i's low nibble) those four
weights sit in two bytes four apart, so the kernel read single bytes and packed them (6.2 SASS
instructions a weight). Stored byte j = k[j] | k[j+8] << 4 of each 16-element slice puts them in one
int16 (triton_gemm._FP4_ASM decodes it: 9 instructions per four weights).
"""

from __future__ import annotations

import torch

FP4_MAX_SCALE_BYTE = 128       # the decode's multiplier 2^(k - 1) must be a normal bf16: block scales up to 2
FP4_MIN_SCALE_BYTE = 2         # 0.5 * 2^(k - 127) a normal bf16 (subnormal products may be flushed)


def fp4_kernel_layout(packed: torch.Tensor) -> torch.Tensor:
    """Release MXFP4 bytes [..., K/2] (element 2i in byte i's low nibble) -> the W4A16 kernels' layout, same
    shape: in each k16 slice (8 bytes) byte j = k[j] | k[j + 8] << 4. Once per weight, at load."""
    u = packed.view(torch.uint8)
    assert u.shape[-1] % 8 == 0, "K must be a multiple of 16"
    nib = torch.stack([u & 15, u >> 4], -1).reshape(*u.shape[:-1], -1, 16)     # [..., K/16, 16] nibbles
    return (nib[..., :8] | (nib[..., 8:] << 4)).reshape(u.shape).contiguous()


def fp4_kernel_weight(packed: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A release MXFP4 weight (packed [..., N, K/2], E8M0 scale [..., N, K/32]) -> what the W4A16 kernels
    read: the bytes in fp4_kernel_layout and the scale bytes with 0 mapped away. The reference decodes
    byte 0 as a zero block (e8m0_to_float(0) = 0.0): its nibbles become +0 and its byte 1, the same
    weights, so the kernel's scale needs no zero test. Check fp4_scales_ok (bytes <= 128) first."""
    u = packed.view(torch.uint8)
    sb = scale.view(torch.uint8)
    zero = (sb == 0).repeat_interleave(16, -1)                                  # the bytes of zero blocks
    return (fp4_kernel_layout(u.masked_fill(zero, 0)),
            torch.where(sb == 0, torch.ones_like(sb), sb).contiguous())


def fp4_release_layout(packed_k: torch.Tensor) -> torch.Tensor:
    """fp4_kernel_layout's inverse (tests, and what a holder of kernel-layout weights hands the reference)."""
    u = packed_k.view(torch.uint8).reshape(*packed_k.shape[:-1], -1, 8)
    nib = torch.cat([u & 15, u >> 4], -1)                                       # k0..k7, k8..k15
    return (nib[..., 0::2] | (nib[..., 1::2] << 4)).reshape(packed_k.shape).contiguous()


def fp4_scales_ok(scale: torch.Tensor) -> bool:
    """Whether the W4A16 decode holds for these release E8M0 block scales: every byte 0 (a zero block,
    fp4_kernel_weight's to map) or in FP4_MIN_SCALE_BYTE..FP4_MAX_SCALE_BYTE (block scales 2^-125..2: every
    nonzero weight a normal bf16, so no GPU flushes one; real MXFP4 experts sit near 2^-8..2^-14). One
    device read: call it once per weight, at load."""
    if scale.numel() == 0:
        return True
    b = scale.view(torch.uint8)
    return bool(((b == 0) | ((b >= FP4_MIN_SCALE_BYTE) & (b <= FP4_MAX_SCALE_BYTE))).all())
