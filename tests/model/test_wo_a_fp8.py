"""wo_a on its FP8 blocks (what a CUDA load does: ops.grouped_w8a16, half the bytes of the dequantized
bf16 copy) computes the block-diagonal product of the same exact weight values as the einsum."""

import pytest
import torch

from deepinfer.model.loader import load_model


@pytest.fixture(scope="module")
def pair(tiny_checkpoint):
    torch.set_num_threads(1)
    kw = dict(progress=False, weight_format="fp8")
    return load_model(tiny_checkpoint, wo_a_fp8=False, **kw), load_model(tiny_checkpoint, wo_a_fp8=True, **kw)


def test_wo_a_blocks_replace_the_dense_copy(pair):
    dense, blocks = pair
    for ld, lb in zip(dense.layers, blocks.layers):
        a, b = ld.attn, lb.attn
        assert a.wo_a.fp8_blocks is None and a.wo_a.weight.numel() > 0
        w, s = b.wo_a.fp8_blocks
        assert w.dtype == torch.float8_e4m3fn and w.shape == (b.n_groups, b.o_lora_rank, a.wo_a.in_features)
        assert b.wo_a.weight.numel() == 0
        from deepinfer.model import ops
        assert torch.equal(ops.dequant_fp8(w, s).flatten(0, 1), a.wo_a.weight.float())


@pytest.mark.parametrize("T", [1, 7])
def test_wo_a_blocks_same_output(pair, T):
    dense, blocks = pair
    torch.manual_seed(T)
    for ld, lb in zip(dense.layers[:3], blocks.layers[:3]):
        a, b = ld.attn, lb.attn
        o = torch.randn(T, a.n_heads, a.head_dim).bfloat16()
        pos = torch.arange(T)
        cis = dense.rope[a.rope_kind](pos, T - 1)
        # fp32 sums of the same exact products in two orders: equal up to fp32 rounding, then bf16
        torch.testing.assert_close(b.out(o, cis).float(), a.out(o, cis).float(), rtol=1e-2, atol=1e-2)


@pytest.fixture(scope="module")
def held_both(tiny_checkpoint):
    """dense_bf16 with FP8 decode copies (the CUDA default's 'auto'): wo_a keeps its bf16 copy and its FP8 blocks."""
    return load_model(tiny_checkpoint, progress=False, weight_format="fp8", dense_bf16=True, dense_fp8_copy=True,
                      wo_a_fp8=True)


def test_wo_a_held_both_ways_under_dense_bf16(held_both, tiny_checkpoint):
    from deepinfer.model import ops
    for layer in held_both.layers:
        wo_a = layer.attn.wo_a
        w, s = wo_a.fp8_blocks
        assert wo_a.weight.numel() > 0 and w.dtype == torch.float8_e4m3fn
        assert torch.equal(ops.dequant_fp8(w, s).flatten(0, 1).to(wo_a.weight.dtype), wo_a.weight)
    # without decode copies (or with wo_a_fp8=False) dense_bf16 holds the bf16 copy alone
    plain = load_model(tiny_checkpoint, progress=False, weight_format="fp8", dense_bf16=True, wo_a_fp8=True)
    assert all(layer.attn.wo_a.fp8_blocks is None for layer in plain.layers)


def test_wo_a_blocks_kept_only_where_the_copies_name_them(tiny_checkpoint):
    """dense_fp8_copy as a set of kinds (dense_weights="auto"): wo_a keeps its FP8 blocks where its kind is named
    (loading.wo_a_copies put it there from what the budget left), else its bf16 copy alone."""
    kw = dict(progress=False, weight_format="fp8", dense_bf16=True, wo_a_fp8=True)
    named = load_model(tiny_checkpoint, dense_fp8_copy=frozenset({"layers.N.attn.wo_a.weight"}), **kw)
    other = load_model(tiny_checkpoint, dense_fp8_copy=frozenset({"layers.N.attn.wq_b.weight"}), **kw)
    assert all(layer.attn.wo_a.fp8_blocks is not None and layer.attn.wo_a.weight.numel() for layer in named.layers)
    assert all(layer.attn.wo_a.fp8_blocks is None and layer.attn.wo_a.weight.numel() for layer in other.layers)


def test_wo_a_copies_take_what_the_budget_leaves(tmp_path):
    """wo_a_copies: the backbone's wo_a first, DSpark's blocks' next, each only where its elements fit."""
    import json

    from deepinfer.checkpoint.generator import hf_config, text_config
    from deepinfer.model.args import ModelArgs
    from deepinfer.worker.loading import fp8_kind_elements, wo_a_copies
    (tmp_path / "config.json").write_text(json.dumps(hf_config(text_config("release-ep8"))))
    args = ModelArgs.from_checkpoint(tmp_path)
    elements = fp8_kind_elements(args)
    backbone, blocks = elements["layers.N.attn.wo_a.weight"], elements["mtp.N.attn.wo_a.weight"]
    assert backbone == args.n_layers * args.o_groups * args.o_lora_rank * args.n_heads * args.head_dim // args.o_groups
    assert wo_a_copies(args, backbone + blocks) == {"layers.N.attn.wo_a.weight", "mtp.N.attn.wo_a.weight"}
    assert wo_a_copies(args, backbone + blocks - 1) == {"layers.N.attn.wo_a.weight"}
    assert wo_a_copies(args, backbone - 1) == ({"mtp.N.attn.wo_a.weight"} if blocks < backbone else set())
    assert wo_a_copies(args, 0) == frozenset()


def test_wo_a_held_both_ways_takes_the_blocks_where_the_rule_says(held_both, pair, monkeypatch):
    """Attention.out runs the FP8 blocks exactly where ops.grouped_takes_fp8 says (the blocks-only model's
    values), else the bf16 copy (the dense model's values)."""
    from deepinfer.model import attention
    dense, blocks = pair
    T = 5
    torch.manual_seed(0)
    for take in (False, True):
        monkeypatch.setattr(attention.ops, "grouped_takes_fp8", lambda o, w, s, take=take: take)
        for lh, ld, lb in zip(held_both.layers[:2], dense.layers[:2], blocks.layers[:2]):
            o = torch.randn(T, lh.attn.n_heads, lh.attn.head_dim).bfloat16()
            cis = dense.rope[lh.attn.rope_kind](torch.arange(T), T - 1)
            want = (lb if take else ld).attn.out(o.clone(), cis)
            torch.testing.assert_close(lh.attn.out(o.clone(), cis), want, rtol=0, atol=0)


def test_grouped_takes_fp8_rule():
    """Only decode-sized calls on the fast path, never batch-invariant mode; the CPU always declines."""
    from deepinfer.kernels import select
    w = torch.zeros(2, 64, 128, dtype=torch.float8_e4m3fn)
    s = torch.zeros(2, 2, 4, dtype=torch.uint8)
    assert not select.grouped_takes_fp8(torch.zeros(4, 2, 128, dtype=torch.bfloat16), w, s)   # CPU
    if torch.cuda.is_available():
        x = torch.zeros(select.GROUPED_FP8_MAX_ROWS, 2, 128, dtype=torch.bfloat16, device="cuda")
        assert select.grouped_takes_fp8(x, w.cuda(), s.cuda())
        assert not select.grouped_takes_fp8(torch.cat([x, x[:1]]), w.cuda(), s.cuda())


@pytest.mark.gpu
def test_wo_a_held_both_ways_on_cuda(tiny_checkpoint, monkeypatch):
    """On CUDA (dense_bf16 with copies) Attention.out runs wo_a's FP8 blocks for 1..64 tokens and the bf16 copy
    above; the two agree to bf16 rounding (the same exact products, fp32 sums in another order)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA")
    from deepinfer.kernels import select
    from deepinfer.model import attention
    held = load_model(tiny_checkpoint, device="cuda", progress=False, weight_format="fp8", dense_bf16=True,
                      dense_fp8_copy=True)
    attn = held.layers[0].attn
    assert attn.wo_a.fp8_blocks is not None and attn.wo_a.weight.numel()
    calls = []
    real = attention.ops.grouped_w8a16
    monkeypatch.setattr(attention.ops, "grouped_w8a16", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    torch.manual_seed(0)
    with torch.inference_mode():
        for T in (1, 64, 65):
            o = torch.randn(T, attn.n_heads, attn.head_dim, device="cuda").bfloat16()
            cis = held.rope[attn.rope_kind](torch.arange(T, device="cuda"), T - 1)
            got = attn.out(o.clone(), cis).float()
            monkeypatch.setattr(select, "GROUPED_FP8_MAX_ROWS", 0)
            dense = attn.out(o.clone(), cis).float()
            monkeypatch.setattr(select, "GROUPED_FP8_MAX_ROWS", 64)
            assert torch.isfinite(got).all()
            torch.testing.assert_close(got, dense, rtol=2e-2, atol=2e-2 * dense.abs().max().item())
    assert calls == [1, 64], calls
