"""Vision tower modules against plain-torch implementations of the reference's semantics (inference/
vision.py, model.py merge_image_embeddings, Gate, engram.py), written here loop by loop from the
reference's definitions (KVCACHE_VISION.md part B), on shapes beyond the checkpoints at hand."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from deepinfer.kernels.batch_invariant import batch_invariant_mode
from deepinfer.model.vision import (IMAGE, IMAGE_END, IMAGE_NEW_LINE, IMAGE_START, TEXT, ImageInput, ImagePlan,
                                    VisionArgs, VisionTower, expand_image_placeholders)
from deepinfer.model.vision.aligner import Aligner, unfold_cells
from deepinfer.model.vision.vit import PatchEmbed, ViT, VisionBlock, VisionRMSNorm, apply_rope_2d, rope_2d_table


def _fill(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    for mod in module.modules():
        for name, buf in list(mod.named_buffers(recurse=False)):
            if buf is None:
                continue
            if name == "weight" and buf.dim() == 1:          # norms
                val = 1 + 0.1 * torch.randn(buf.shape, generator=g)
            elif buf.dim() == 2:
                val = torch.randn(buf.shape, generator=g) * buf.shape[1] ** -0.5
            else:
                val = 0.1 * torch.randn(buf.shape, generator=g)
            setattr(mod, name, val)
    return module


def _args(**kw) -> VisionArgs:
    base = dict(n_layers=2, dim=64, n_heads=4, inter_dim=96, patch_size=14, downsample_ratio=3)
    return VisionArgs(**{**base, **kw})


def _image(plan: ImagePlan, seed: int) -> ImageInput:
    g = torch.Generator().manual_seed(seed)
    patches = (torch.rand(plan.n_vit_h * plan.n_vit_w, 3, 14, 14, generator=g) * 2 - 1).to(torch.bfloat16)
    return ImageInput(patches, plan, content_hash=f"img{seed}")


def _plan(n_vit_h: int, n_vit_w: int) -> ImagePlan:
    return ImagePlan(n_vit_w * 14, n_vit_h * 14, n_vit_h, n_vit_w, math.ceil(n_vit_h / 3), math.ceil(n_vit_w / 3))


# ---- references -------------------------------------------------------------------------------
def rope_ref(x: torch.Tensor, n_h: int, n_w: int, theta: float) -> torch.Tensor:
    """x [n, H, hd]: patch k at (k // n_w, k % n_w); dims j < hd/4 turn with h * f_j, the next hd/4 with
    w * f_j; element i of the first half pairs with element i + hd/2 (rotate-half)."""
    n, H, hd = x.shape
    half, quarter = hd // 2, hd // 4
    freqs = [theta ** (-(2 * j) / half) for j in range(quarter)]
    out = torch.empty(n, H, hd, dtype=torch.float32)
    xf = x.float()
    for k in range(n):
        hpos, wpos = k // n_w, k % n_w
        for i in range(half):
            ang = torch.tensor((hpos if i < quarter else wpos) * freqs[i % quarter], dtype=torch.float32)
            c, s = ang.cos(), ang.sin()
            out[k, :, i] = xf[k, :, i] * c - xf[k, :, i + half] * s
            out[k, :, i + half] = xf[k, :, i + half] * c + xf[k, :, i] * s
    return out.to(x.dtype)


def rms_ref(x, w, eps=1e-6):
    xf = x.float()
    return (w.float() * xf / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def block_ref(blk: VisionBlock, x: torch.Tensor, n_h: int, n_w: int, theta: float) -> torch.Tensor:
    """Pre-norm block with explicit softmax attention, head by head."""
    H = blk.attn.n_heads
    hd = x.shape[1] // H
    lin = lambda m, t: (t.float() @ m.weight.float().T + (0 if m.bias is None else m.bias.float())).to(torch.bfloat16)  # noqa: E731
    h = rms_ref(x, blk.norm1.weight)
    qkv = lin(blk.attn.wqkv, h)
    q, k, v = (qkv[:, i * x.shape[1]:(i + 1) * x.shape[1]].reshape(-1, H, hd) for i in range(3))
    q, k = rope_ref(q, n_h, n_w, theta), rope_ref(k, n_h, n_w, theta)
    outs = []
    for head in range(H):
        att = (q[:, head].float() @ k[:, head].float().T) / math.sqrt(hd)
        outs.append(att.softmax(-1) @ v[:, head].float())
    x = x + lin(blk.attn.wo, torch.cat(outs, -1).to(torch.bfloat16))
    g = lin(blk.mlp.w1, rms_ref(x, blk.norm2.weight))
    inter = g.shape[1] // 2
    return x + lin(blk.mlp.w2, (F.silu(g[:, :inter].float()) * g[:, inter:].float()).to(torch.bfloat16))


def unfold_ref(x: torch.Tensor, n_h: int, n_w: int, r: int) -> torch.Tensor:
    """Cells in reading order; each cell's vector lists channel c's r x r window row by row, c by c."""
    C = x.shape[1]
    grid = x.view(n_h, n_w, C)
    rows = []
    for i in range(math.ceil(n_h / r)):
        for j in range(math.ceil(n_w / r)):
            vec = []
            for c in range(C):
                for kh in range(r):
                    for kw in range(r):
                        y, xx = i * r + kh, j * r + kw
                        vec.append(grid[y, xx, c] if y < n_h and xx < n_w else torch.zeros((), dtype=x.dtype))
            rows.append(torch.stack(vec))
    return torch.stack(rows)


# ---- tests ----------------------------------------------------------------------------------
def test_patch_embed_is_a_linear_over_c_y_x_flattened_patches():
    v = _args()
    pe = _fill(PatchEmbed(v))
    patches = torch.randn(7, 3, 14, 14).to(torch.bfloat16)
    want = patches.float().reshape(7, -1) @ pe.proj.weight.float().T + pe.proj.bias.float()
    torch.testing.assert_close(pe(patches).float(), want, atol=3e-2, rtol=1e-2)
    # (c, y, x) order: moving one pixel to another channel changes the result
    swapped = patches.clone()
    swapped[:, [0, 1]] = patches[:, [1, 0]]
    assert not torch.allclose(pe(swapped).float(), pe(patches).float())


@pytest.mark.parametrize("n_h,n_w,head_dim", [(1, 1, 16), (3, 5, 16), (6, 2, 64), (4, 4, 32)])
def test_rope_2d_matches_the_loop_reference(n_h, n_w, head_dim):
    x = torch.randn(n_h * n_w, 3, head_dim)
    cos, sin = rope_2d_table(n_h, n_w, head_dim // 2, 10000.0)
    torch.testing.assert_close(apply_rope_2d(x, cos, sin), rope_ref(x, n_h, n_w, 10000.0), atol=1e-5, rtol=1e-5)


def test_rope_2d_scores_depend_on_relative_offsets_only():
    """q.k after rotation is a function of (dh, dw): the property 2D RoPE exists for."""
    n_h, n_w, hd = 5, 6, 32
    cos, sin = rope_2d_table(n_h, n_w, hd // 2, 10000.0)
    q0, k0 = torch.randn(1, 1, hd, dtype=torch.float64), torch.randn(1, 1, hd, dtype=torch.float64)
    q = apply_rope_2d(q0.expand(n_h * n_w, 1, hd).float(), cos, sin).double()[:, 0]
    k = apply_rope_2d(k0.expand(n_h * n_w, 1, hd).float(), cos, sin).double()[:, 0]
    at = lambda a, b: a * n_w + b  # noqa: E731
    s1 = q[at(3, 4)] @ k[at(1, 2)]
    s2 = q[at(2, 3)] @ k[at(0, 1)]
    s3 = q[at(2, 4)] @ k[at(0, 1)]
    assert torch.allclose(s1, s2, atol=1e-4) and not torch.allclose(s1, s3, atol=1e-3)


@pytest.mark.parametrize("n_h,n_w", [(2, 3), (4, 4), (1, 7)])
def test_vision_block_matches_the_reference_block(n_h, n_w):
    v = _args(dim=64, n_heads=4)
    blk = _fill(VisionBlock(v), seed=n_h * 10 + n_w)
    x = torch.randn(n_h * n_w, 64).to(torch.bfloat16)
    cos, sin = rope_2d_table(n_h, n_w, v.rope_dim, v.rope_theta)
    got = blk(x, cos, sin, [0, n_h * n_w])
    torch.testing.assert_close(got.float(), block_ref(blk, x, n_h, n_w, v.rope_theta).float(), atol=6e-2, rtol=3e-2)


def test_vit_over_several_images_equals_each_alone():
    """One flat pass, attention image by image: batch-invariant mode makes it bit-exact."""
    v = _args()
    vit = _fill(ViT(v), seed=3)
    imgs = [_image(_plan(3, 5), 1), _image(_plan(4, 2), 2), _image(_plan(1, 1), 3)]
    grids = [(im.plan.n_vit_h, im.plan.n_vit_w) for im in imgs]
    with batch_invariant_mode(True):
        together = vit(torch.cat([im.patches for im in imgs]), grids)
        alone = torch.cat([vit(im.patches, [g]) for im, g in zip(imgs, grids)])
    assert torch.equal(together, alone)


def test_tower_encode_in_any_order_equals_each_alone():
    """encode orders images by size for the ViT (equal sizes share an attention call) and hands the
    spans back in the caller's order: bit-exact under batch-invariant mode."""
    v = _args()
    tower = _fill(VisionTower(v, dim=32), seed=9)
    imgs = [_image(_plan(6, 5), 1), _image(_plan(2, 2), 2), _image(_plan(6, 5), 3), _image(_plan(1, 4), 4)]
    with batch_invariant_mode(True):
        together = tower.encode(imgs)
        alone = [tower.encode([im])[0] for im in imgs]
    assert [t.shape[0] for t in together] == [im.span_len for im in imgs]
    assert all(torch.equal(a, b) for a, b in zip(together, alone))


def test_rms_norm_fp32_then_one_rounding():
    """The model's rms_norm op (Triton on the GPU) against the reference's spelled-out fp32 form
    (weight times the normalized fp32 x, one bf16 rounding): at most one bf16 ulp apart."""
    norm = _fill(VisionRMSNorm(1024), seed=2)
    x = (torch.randn(300, 1024) * 3).to(torch.bfloat16)
    torch.testing.assert_close(norm(x).float(), rms_ref(x, norm.weight).float(), atol=0, rtol=2 ** -7)


def test_vit_fast_path_equals_the_plain_reference():
    """The fast path (fused q/k rope, one 4-D SDPA per run of equal-size images, rope tables made on
    the device, the tower's size ordering and one-gather span assembly) against the plain loop
    reference image by image: patch embed, block_ref per layer (explicit softmax, head by head),
    final norm, unfold_ref + the aligner MLP, and the span laid out slot by slot."""
    v = _args(n_layers=2)
    tower = _fill(VisionTower(v, dim=48), seed=11)
    plans = [_plan(3, 5), _plan(4, 2), _plan(3, 5), _plan(3, 5), _plan(1, 1), _plan(4, 2)]   # runs and repeats
    imgs = [_image(p, 20 + i) for i, p in enumerate(plans)]
    got = tower.encode(imgs)
    lin = lambda m, t: (t.float() @ m.weight.float().T + m.bias.float()).to(torch.bfloat16)  # noqa: E731
    for im, span in zip(imgs, got):
        n_h, n_w = im.plan.n_vit_h, im.plan.n_vit_w
        x = lin(tower.vit.patch_embed.proj, im.patches.flatten(1))
        for blk in tower.vit.blocks:
            x = block_ref(blk, x, n_h, n_w, v.rope_theta)
        x = rms_ref(x, tower.vit.norm.weight)
        h = lin(tower.aligner.w1, unfold_ref(x, n_h, n_w, 3)).float()
        rows = lin(tower.aligner.w2, (0.5 * h * (1 + torch.erf(h / math.sqrt(2)))).to(torch.bfloat16))
        want, k = [], 0
        for t in im.token_types.tolist():
            if t == IMAGE:
                want.append(rows[k])
                k += 1
            else:
                want.append({IMAGE_START: tower.image_start, IMAGE_END: tower.image_end,
                             IMAGE_NEW_LINE: tower.image_newline}[t].to(torch.bfloat16))
        assert span.shape == (im.span_len, 48)
        torch.testing.assert_close(span.float(), torch.stack(want).float(), atol=6e-2, rtol=3e-2)


@pytest.mark.parametrize("n_h,n_w", [(3, 3), (4, 5), (7, 2), (1, 1), (6, 9)])
def test_aligner_unfold_order(n_h, n_w):
    x = torch.randn(n_h * n_w, 5)
    assert torch.equal(unfold_cells(x, n_h, n_w, 3), unfold_ref(x, n_h, n_w, 3))


def test_aligner_mlp_uses_exact_gelu_and_biases():
    v = _args()
    al = _fill(Aligner(v, dim=48), seed=5)
    feats = torch.randn(4 * 5, v.dim).to(torch.bfloat16)
    cells = unfold_ref(feats, 4, 5, 3).float()
    h = (cells @ al.w1.weight.float().T + al.w1.bias.float()).to(torch.bfloat16).float()
    h = (0.5 * h * (1 + torch.erf(h / math.sqrt(2)))).to(torch.bfloat16).float()
    want = h @ al.w2.weight.float().T + al.w2.bias.float()
    torch.testing.assert_close(al(feats, [(4, 5)]).float(), want, atol=5e-2, rtol=2e-2)


def test_span_layout_and_merge_order():
    """START, rows of (IMAGE x n_w, NEW_LINE), END; IMAGE slots take aligner rows row-major."""
    v = _args()
    tower = _fill(VisionTower(v, dim=32), seed=7)
    im = _image(_plan(7, 5), 4)                    # 3 x 2 LLM tokens: span 3 * 3 + 2 = 11
    assert im.span_len == 11
    assert im.token_types.tolist() == [IMAGE_START, IMAGE, IMAGE, IMAGE_NEW_LINE, IMAGE, IMAGE, IMAGE_NEW_LINE,
                                       IMAGE, IMAGE, IMAGE_NEW_LINE, IMAGE_END]
    span = tower.encode([im])[0]
    grid = [(7, 5)]
    rows = tower.aligner(tower.vit(im.patches, grid), grid)
    k = 0
    for pos, t in enumerate(im.token_types.tolist()):
        if t == IMAGE:
            assert torch.equal(span[pos], rows[k])
            k += 1
        else:
            vec = {IMAGE_START: tower.image_start, IMAGE_END: tower.image_end, IMAGE_NEW_LINE: tower.image_newline}[t]
            assert torch.equal(span[pos], vec.to(torch.bfloat16))
    assert k == rows.shape[0] == 6


def test_expand_placeholders_positions_and_types():
    a, b = _image(_plan(3, 3), 1), _image(_plan(4, 6), 2)      # spans 1*2+2 = 4 and 2*3+2 = 8
    ip = expand_image_placeholders([5, 9, 42, 7, 9, 8], [a, b], 9)
    assert ip.token_ids == [5] + [9] * 4 + [42, 7] + [9] * 8 + [8]
    assert ip.spans == [(1, 5), (7, 15)]
    assert ip.token_types[0] == TEXT and ip.token_types[5] == TEXT and ip.token_types[-1] == TEXT
    assert ip.token_types[1:5].tolist() == a.token_types.tolist()
    assert a.start == -1                         # the caller's ImageInput is not modified
    with pytest.raises(ValueError, match="2 image placeholders but 1 images"):
        expand_image_placeholders([9, 9], [a], 9)


def test_gate_bias_vl_at_span_positions(tiny_vision_model):
    """topk(scores + (bias_vl at span tokens else bias)), weights from the unbiased scores."""
    gate = tiny_vision_model.layers[2].ffn.gate
    assert not torch.equal(gate.bias, gate.bias_vl)             # read from the checkpoint
    x = torch.randn(12, gate.weight.shape[1]).to(torch.bfloat16)
    mask = torch.arange(12) % 3 == 0
    w, idx = gate(x, mask)
    scores = F.softplus(x.float() @ gate.weight.float().T).sqrt()
    bias = torch.where(mask[:, None], gate.bias_vl, gate.bias)
    want_idx = (scores + bias).topk(gate.topk, dim=-1).indices
    assert torch.equal(idx.sort(-1).values, want_idx.sort(-1).values)
    ws = scores.gather(1, idx)
    torch.testing.assert_close(w, ws / (ws.sum(-1, keepdim=True) + 1e-20) * gate.route_scale)
    _, idx_text = gate(x, None)
    assert not torch.equal(idx_text[mask], idx[mask]) and torch.equal(idx_text[~mask], idx[~mask])


def engram_tokens_ref(ids, dead, pad, n):
    """Per position: the ids at p, p-1, .., p-n+1; a look-back before 0 or at/after a DEAD one -> pad."""
    out = []
    for p in range(len(ids)):
        row, blocked = [], False
        for s in range(n):
            q = p - s
            blocked = blocked or q < 0 or dead[q]
            row.append(pad if blocked else ids[q])
        out.append(row)
    return out


def test_engram_dead_positions(tiny_vision_model):
    """Span tokens hash as pad (and stop the look-back of the tokens after them); the gate is 0 there,
    and the history carried over a chunk boundary after a span says DEAD."""
    from deepinfer.worker.input_batch import InputBatch
    hasher = tiny_vision_model.hasher
    ids = torch.tensor([11, 12, 9, 9, 9, 13, 14, 15, 16])
    dead = torch.tensor([False, False, True, True, True, False, False, False, False])
    got = hasher(ids, torch.tensor([0, 9]), torch.full((1, 3), -1), ~dead)
    comp = hasher.token_map[ids].tolist()
    toks = torch.tensor(engram_tokens_ref(comp, dead.tolist(), hasher.pad_id, hasher.max_ngram))
    products = toks[:, None, :] * hasher.multipliers
    rolling, want = products[..., 0], []
    for i in range(1, hasher.max_ngram):
        rolling = torch.bitwise_xor(rolling, products[..., i])
        want.append(rolling[..., None] % hasher.primes[:, i - 1])
    assert torch.equal(got, torch.cat(want, -1) + hasher.offsets)
    # the same prompt in two chunks [0, 6) + [6, 9): the second chunk's history comes from InputBatch
    ib = InputBatch(2, 32, 4, 3)
    ib.token_ids[0, :9] = ids.numpy()
    ib.token_types[0, 2:5] = [IMAGE_START, IMAGE, IMAGE_END]
    ib.has_images[0] = True
    hist = torch.from_numpy(ib._history(np.array([0]), np.array([6])))
    assert hist.tolist() == [[-2, -2, 13]]
    second = hasher(ids[6:], torch.tensor([0, 3]), torch.from_numpy(ib._history(np.array([0]), np.array([6]))),
                    ~dead[6:])
    assert torch.equal(second, got[6:])
    from deepinfer.model import ops
    layer = tiny_vision_model.layers[tiny_vision_model.args.engram_layer_ids[0]].engram
    x = torch.randn(9, 4, tiny_vision_model.args.dim).to(torch.bfloat16)
    key = torch.randn(9, 4 * tiny_vision_model.args.dim)
    value = torch.randn(9, tiny_vision_model.args.dim)
    w = torch.ones(4, tiny_vision_model.args.dim)
    out = ops.engram_gate(x, key, value, w, layer.eps, ~dead)
    assert torch.equal(out[dead], x[dead])                      # gate 0: the stream passes untouched
    assert not torch.equal(out[~dead], x[~dead])


def test_model_merges_span_rows_before_the_hc_expansion(tiny_vision_model):
    m = tiny_vision_model
    im = _image(_plan(6, 6), 9)                                 # 2 x 2: span 2*3+2 = 8
    ip = expand_image_placeholders([0, 100, 129264, 200], [im], 129264)
    span = m.vision_tower.encode(ip.images)[0]
    hidden = _first_stream(m, ip, span)
    T = len(ip.token_ids)
    s, e = ip.spans[0]
    for c in range(m.args.hc_mult):                             # every hc copy starts as the merged row
        assert torch.equal(hidden[s:e, c].to(torch.bfloat16), span)
    text = torch.tensor([i for i in range(T) if not s <= i < e])
    emb = m.embed(torch.tensor(ip.token_ids)[text])
    assert torch.equal(hidden[text, 0].to(torch.bfloat16), emb)


def _first_stream(m, ip, span):
    """The stream entering layer 0 (dump_hidden) for one prompt with its image rows."""
    from deepinfer.cache.model_caches import ModelCaches
    from deepinfer.model.batch import ForwardBatch
    T = len(ip.token_ids)
    caches = ModelCaches.allocate(m.args, 1, 4, 64)
    types = torch.from_numpy(ip.token_types.astype(np.int64))
    s, e = ip.spans[0]
    batch = ForwardBatch(
        input_ids=torch.tensor(ip.token_ids), positions=torch.arange(T), cu_seqlens=torch.tensor([0, T]),
        start_pos=torch.tensor([0]), ngram_history=torch.full((1, 3), -1), ring_slots=torch.tensor([0]),
        block_tables=torch.tensor([[0, 1, 2, 3]]), logits_indices=torch.tensor([T - 1]), token_mask=types < 0,
        image_rows=torch.arange(s, e), image_embeds=span)
    return m(batch, caches, dump_hidden=True).hidden[0]


def test_loader_maps_the_release_names(tiny_vision_model, tiny_checkpoint):
    """vision.* -> vision_tower.vit.*, aligner.* -> vision_tower.aligner.*, image_* -> vision_tower.image_*,
    with the checkpoint's values; a text-only config builds no tower."""
    from safetensors import safe_open
    from deepinfer.model.args import ModelArgs
    tower = tiny_vision_model.vision_tower
    names = {"vision.blocks.1.mlp.w2.weight": tower.vit.blocks[1].mlp.w2.weight,
             "vision.patch_embed.proj.bias": tower.vit.patch_embed.proj.bias,
             "vision.norm.weight": tower.vit.norm.weight, "aligner.w1.bias": tower.aligner.w1.bias,
             "aligner.w2.weight": tower.aligner.w2.weight, "image_newline": tower.image_newline}
    shard = next(tiny_checkpoint.glob("model-*.safetensors"))
    with safe_open(str(shard), "pt") as f:
        for name, buf in names.items():
            assert torch.equal(f.get_tensor(name).float(), buf.float()), name
    cfg = ModelArgs.from_checkpoint(tiny_checkpoint)
    assert cfg.vision.n_layers == 2 and cfg.vision.dim == 64
    import json
    hf = json.loads((tiny_checkpoint / "config.json").read_text())
    hf.pop("vision_config")
    assert ModelArgs.from_hf_config(hf).vision is None
