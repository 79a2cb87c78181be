"""FlashMLA sparse decode (SM90 build bundled in vllm 0.33.0) with the V4 584-byte KV record.

Import order: `flash_mla`, then `vllm.third_party.flashmla.flash_mla_interface`; None otherwise.

V4 record (FlashMLA tests/quant.py "MODEL1"): per page of `block` tokens, `block` data rows of
448 e4m3 NoPE values + 64 bf16 RoPE values (576 B), then `block` scale rows of 8 B (7 E8M0
scales, one per 64 NoPE dims, + 1 pad); the page is padded to a multiple of 576 B.

Where our semantics fit: the window KV is FP8 per 32 (pow2) over all 512 dims. In the V4 record
the 64 RoPE dims are bf16 (our values are exact there) and the NoPE part gets one scale per 64:
the pair of our per-32 scales is re-expressed at their max (exact except tails below 2^-6 of
the larger scale, as in deepgemm.py). The compressed KV is FP4 with e4m3 scales per 16
(values need up to 5 significant bits): it does NOT fit the e4m3 NoPE part exactly. So FlashMLA
on SM90 is an approximation of our attention and serves as the speed baseline; the Triton kernel
(triton_sparse_attn.py) is the exact path. The 528-B V4.1 record, which would fit the window KV
exactly, is SM100-only in this build.
"""

from __future__ import annotations

import torch

from .optional import first_importable

D_NOPE, D_ROPE, TILE, NUM_TILES = 448, 64, 64, 7
BYTES_PER_TOKEN = D_NOPE + 2 * D_ROPE + NUM_TILES + 1           # 584


def load():
    """The FlashMLA interface module (with flash_mla_with_kvcache), or None."""
    return first_importable("flash_mla", "vllm.third_party.flashmla.flash_mla_interface")


def pack_v4(kv: torch.Tensor, block: int = 64) -> torch.Tensor:
    """kv [num_rows, 512] (bf16) -> FlashMLA V4 cache view [num_blocks, block, 1, 584] (fp8 dtype),
    rows padded with zeros to whole pages. Row r lives at page r // block, slot r % block."""
    rows = kv.shape[0]
    nb = -(-rows // block)
    x = torch.zeros(nb * block, 512, dtype=torch.bfloat16, device=kv.device)
    x[:rows] = kv.to(torch.bfloat16)
    x = x.view(nb, block, 512)
    per_page = -(-(block * BYTES_PER_TOKEN) // 576) * 576
    buf = torch.zeros(nb, per_page, dtype=torch.float8_e4m3fn, device=kv.device)
    data = buf[:, :block * (D_NOPE + 2 * D_ROPE)].view(nb, block, D_NOPE + 2 * D_ROPE)
    data[:, :, D_NOPE:].view(torch.bfloat16).copy_(x[..., D_NOPE:])
    scales = buf[:, block * (D_NOPE + 2 * D_ROPE): block * BYTES_PER_TOKEN].view(nb, block, 8)
    nope = x[..., :D_NOPE].float().view(nb, block, NUM_TILES, TILE)
    amax = nope.abs().amax(-1).clamp_min(1e-4) / 448.0
    bits = amax.contiguous().view(torch.int32)
    e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    s = (e << 23).view(torch.float32)
    data[:, :, :D_NOPE].copy_((nope / s[..., None]).view(nb, block, D_NOPE).to(torch.float8_e4m3fn))
    scales[:, :, :NUM_TILES].view(torch.uint8).copy_(e.to(torch.uint8))
    return buf[:, :block * BYTES_PER_TOKEN].view(nb, block, 1, BYTES_PER_TOKEN)


def unpack_v4(cache: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_v4 -> [num_blocks * block, 512] bf16 (what FlashMLA will read)."""
    nb, block = cache.shape[:2]
    flat = cache.view(nb, -1) if cache.is_contiguous() else cache.as_strided((nb, block * BYTES_PER_TOKEN),
                                                                                (cache.stride(0), 1))
    data = flat[:, :block * (D_NOPE + 2 * D_ROPE)].reshape(nb, block, D_NOPE + 2 * D_ROPE)
    sc = flat[:, block * (D_NOPE + 2 * D_ROPE):].reshape(nb, block, 8)[..., :NUM_TILES].view(torch.uint8)
    s = (sc.to(torch.int32) << 23).view(torch.float32)
    nope = data[..., :D_NOPE].float().view(nb, block, NUM_TILES, TILE) * s[..., None]
    rope = data[..., D_NOPE:].contiguous().view(torch.bfloat16).float()
    return torch.cat([nope.view(nb, block, D_NOPE), rope], -1).view(nb * block, 512).to(torch.bfloat16)


def sparse_decode(q: torch.Tensor, cache: torch.Tensor, indices: torch.Tensor, sink: torch.Tensor, scale: float,
                  sched=None):
    """q [b, H, 512] bf16, cache from pack_v4, indices [b, topk] int32 rows of the cache (-1 =
    nothing), sink [H] f32 -> (out [b, H, 512] bf16, sched) ; pass sched back in to reuse the
    tile-scheduler metadata (same shapes only)."""
    mod = load()
    if sched is None:
        sched = mod.get_mla_metadata()[0]
    out, _ = mod.flash_mla_with_kvcache(q.unsqueeze(1), cache, None, None, 512, sched, softmax_scale=scale,
                                        is_fp8_kvcache=True, indices=indices.to(torch.int32).unsqueeze(1),
                                        attn_sink=sink.float())
    return out.squeeze(1), sched


SPARSE_PREFILL_HEADS = (64, 128)       # the SM90 sparse prefill kernel's q heads (d_qk 512)
SPARSE_PREFILL_TOPK_ALIGN = 128        # its lists are walked two blocks of 64 at a time (topk % (2 * B_TOPK) == 0)


def sparse_prefill(q: torch.Tensor, kv, sink: torch.Tensor, idxs: torch.Tensor, scale: float) -> torch.Tensor:
    """Sink attention of each query over its own rows of bf16 kv (K = V), sparse_attn_ref's contract, on
    FlashMLA's sparse prefill kernel (flash_mla_sparse_fwd): q [n, H, 512] bf16 with H 64 or 128, kv
    [M, 512] bf16 or a tuple of such tensors that idxs counts across in order (concatenated here: the
    kernel reads one), sink [H] fp32, idxs [n, L] (-1 = nothing; lists padded to a multiple of 128 with
    -1). Its sink term multiplies the output by exp(lse) / (exp(lse) + exp(sink)): the reference's
    denominator."""
    if isinstance(kv, (tuple, list)):
        kv = kv[0] if len(kv) == 1 else torch.cat(kv)
    n, L = idxs.shape
    pad = -L % SPARSE_PREFILL_TOPK_ALIGN
    idx = idxs.to(torch.int32)
    if pad:
        idx = torch.nn.functional.pad(idx, (0, pad), value=-1)
    out = load().flash_mla_sparse_fwd(q.contiguous(), kv.contiguous().unsqueeze(1), idx.contiguous().unsqueeze(1),
                                      scale, 512, attn_sink=sink.float().contiguous())
    return out[0] if isinstance(out, (tuple, list)) else out
