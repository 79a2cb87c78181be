"""Random-weight DeepSeek-V4.1-Flash checkpoints in exactly the release format.

    config.json                         HF style (top level + text_config, release key names)
    model-0000k-of-0000N.safetensors    release tensor names and dtypes: F8_E4M3 linears with an
                                        F8_E8M0 `.scale` per 32x32 block, I8-packed FP4 routed experts
                                        (element 2j in the low nibble) with an F8_E8M0 scale per 32
                                        along K, BF16 / F32 elsewhere, Engram tables FP8 + per-32 scales
    model.safetensors.index.json        weight_map + metadata.total_size
    tokenizer.json                      V4 vocabulary, id 128799 renamed <｜System｜>

Weights are drawn per tensor from (seed, crc32(name)), so a tensor does not depend on which others
exist. Scaling keeps activations finite and greedy tokens varied: linears ~ N(0, 1/fan_in), norm
weights ~ 1, mHC post coefficients damped and comb near-diagonal (each sublayer writes a little,
streams keep their own residual), routed experts share a common direction (routing flips change
less), and head rows with a spread of norms (clear top-1 margins over 129280 rows).
Very large expert matrices (full-width preset) draw their FP4 codes directly (uniform nibbles) to
keep generation fast; the resulting weights have the same scale.
"""

from __future__ import annotations

import json
import math
import os
import zlib
from pathlib import Path

import torch

from deepinfer.kernels import e2m1_round

from .tokenizer import write_tokenizer

VOCAB = 129280

COMMON = dict(
    vocab_size=VOCAB, num_key_value_heads=1, hidden_act="silu", swiglu_limit=10.0, rms_norm_eps=1e-20,
    attention_bias=False, attention_dropout=0.0, initializer_range=0.02, use_cache=True,
    tie_word_embeddings=False, max_position_embeddings=1048576, rope_theta=10000,
    rope_scaling=dict(rope_type="yarn", factor=16, beta_fast=32, beta_slow=1, original_max_position_embeddings=65536),
    n_shared_experts=1, scoring_func="sqrtsoftplus", topk_method="noaux_tc", norm_topk_prob=True,
    routed_scaling_factor=1.5, sliding_window=128, compress_rope_theta=160000, hc_mult=4, hc_sinkhorn_iters=20,
    hc_eps=1e-6, engram_max_ngram_size=4, engram_pad_token_id=2, engram_compressed_vocab_size=99092,
    dspark_block_size=5, dspark_noise_token_id=128799, num_nextn_predict_layers=3,
)

PRESETS = {
    # the fixtures' layout: window-only 0-1, ratio-2 sources 2 and 4 (reusers 3, 5), ratio-1 candidate
    # source 6 (reuser 7, re-indexer 8, reuser 9), Engram at 1 and 4, DSpark on 7-9
    "tiny": dict(
        hidden_size=32, moe_intermediate_size=64, num_attention_heads=4, head_dim=64, qk_rope_head_dim=16,
        q_lora_rank=64, o_lora_rank=32, o_groups=2, n_routed_experts=8, num_experts_per_tok=3,
        compress_ratios=[0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0], kv_source_layer_ids=[2, 4, 6],
        index_source_layer_ids=[2, 4, 6, 8], index_n_heads=16, index_head_dim=32, index_topk=32,
        candidate_source_layer_id=6, candidate_topk_blocks=16, candidate_block_size=8, engram_layer_ids=[1, 4],
        engram_vocab_size=1000, engram_n_heads=2, engram_head_dim=32, dspark_target_layer_ids=[7, 8, 9],
        dspark_markov_rank=8, dspark_n_routed_experts=4, dspark_num_experts_per_tok=2),
    "small": dict(
        hidden_size=256, moe_intermediate_size=256, num_attention_heads=8, head_dim=128, qk_rope_head_dim=32,
        q_lora_rank=256, o_lora_rank=128, o_groups=4, n_routed_experts=32, num_experts_per_tok=4,
        compress_ratios=[0, 0] + [2] * 6 + [1] * 8 + [0, 0, 0], kv_source_layer_ids=[2, 5, 8],
        index_source_layer_ids=[2, 5, 8, 12], index_n_heads=8, index_head_dim=64, index_topk=128,
        candidate_source_layer_id=8, candidate_topk_blocks=32, candidate_block_size=8, engram_layer_ids=[1, 5],
        engram_vocab_size=5000, engram_n_heads=4, engram_head_dim=64, dspark_target_layer_ids=[13, 14, 15],
        dspark_markov_rank=64, dspark_n_routed_experts=8, dspark_num_experts_per_tok=2),
    # real widths; one layer per role: 0 window-only, 1 window-only + Engram, 2 ratio-2 KV/index source,
    # 3 ratio-2 reuser, 4 ratio-1 source + candidate source + Engram, 5 re-indexer, 6 reuser; DSpark on 4-6
    "full-width-layers": dict(
        hidden_size=5120, moe_intermediate_size=2304, num_attention_heads=64, head_dim=512, qk_rope_head_dim=64,
        q_lora_rank=1280, o_lora_rank=1024, o_groups=8, n_routed_experts=384, num_experts_per_tok=6,
        compress_ratios=[0, 0, 2, 2, 1, 1, 1, 0, 0, 0], kv_source_layer_ids=[2, 4],
        index_source_layer_ids=[2, 4, 5], index_n_heads=32, index_head_dim=128, index_topk=512,
        candidate_source_layer_id=4, candidate_topk_blocks=2048, candidate_block_size=8, engram_layer_ids=[1, 4],
        engram_vocab_size=20000, engram_n_heads=8, engram_head_dim=256, dspark_target_layer_ids=[4, 5, 6],
        dspark_markov_rank=256, dspark_n_routed_experts=128, dspark_num_experts_per_tok=3),
}
# one GPU's share at EP8 (48 of the 384 routed experts, 16 of DSpark's 128), the rest full width: the
# GPU decode benchmark (perf/bench_model_decode.py) loads it where the whole preset (~75 GB) does not fit
PRESETS["full-width-ep8"] = dict(PRESETS["full-width-layers"], n_routed_experts=48, dspark_n_routed_experts=16)
# the release's whole layer stack (MODEL.md 2.1: 40 layers and their roles, 3 DSpark blocks) at one GPU's
# EP8 share of the experts (~85 GB with dummy weights): one H200 then runs a real 40-layer step, where
# the 7-layer presets only support an estimate
PRESETS["release-ep8"] = dict(
    PRESETS["full-width-ep8"], compress_ratios=[0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0],
    kv_source_layer_ids=[2, 8, 14, 20], index_source_layer_ids=[2, 8, 14, 20, 24, 28, 32, 36],
    candidate_source_layer_id=20, engram_layer_ids=[1, 14], dspark_target_layer_ids=[37, 38, 39])

# vision_config per preset (HF keys); presets without one write text-only checkpoints. tiny: a small
# tower with small spans (fast CPU tests); full width: the release tower (MODEL.md section 2.1)
RELEASE_VISION = dict(model_type="deepseek_v41_vision", num_hidden_layers=32, hidden_size=1024, num_attention_heads=16,
                      intermediate_size=2816, patch_size=14, rope_theta=10000, downsample_ratio=3,
                      max_image_tokens=1024, min_pixels=295936, max_wh_ratio=None)
VISION = {
    "tiny": dict(RELEASE_VISION, num_hidden_layers=2, hidden_size=64, num_attention_heads=4, intermediate_size=96,
                 max_image_tokens=64, min_pixels=84 * 84),
    "full-width-layers": RELEASE_VISION,
    "full-width-ep8": RELEASE_VISION,
    "release-ep8": RELEASE_VISION,
}

INIT = dict(post_base=-2.0, comb_diag=1.0, expert_spread=0.3, gate_bias_std=1.0, head_std=7.0, head_norm_sigma=0.8)
SHARD_BYTES = 2 << 30
DIRECT_FP4_NUMEL = 1 << 22     # expert matrices above this draw FP4 codes directly


def text_config(preset: str | dict) -> dict:
    """The text_config of a preset name, or of a dict of keys over COMMON (a custom shape: tests
    draw random valid configs this way, tests/kernels/random_configs.py)."""
    from deepinfer.model.engram import engram_primes
    tc = dict(COMMON, **(PRESETS[preset] if isinstance(preset, str) else preset))
    tc["model_type"] = "deepseek_v41_text"
    tc["num_hidden_layers"] = len(tc["compress_ratios"]) - tc["num_nextn_predict_layers"]
    primes = engram_primes(tc["engram_layer_ids"], tc["engram_max_ngram_size"], tc["engram_n_heads"],
                           tc["engram_vocab_size"])
    tc["engram_num_embeddings"] = [sum(map(sum, layer)) for layer in primes]
    return tc


def hf_config(tc: dict, vision: dict | None = None, weights: str = "release") -> dict:
    """weights "bf16": no quantization_config (every linear stored as BF16, the bf16 fixtures' kind)."""
    cfg = {
        "architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "dtype": "bfloat16",
        "transformers_version": "5.6.0", "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2,
        "image_token_id": 129264,
        "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32],
                                "scale_fmt": "ue8m0", "expert_dtype": "fp4"},
        "text_config": tc,
    }
    if vision is not None:
        cfg["vision_config"] = vision
    if weights == "bf16":
        del cfg["quantization_config"]
    return cfg


def as_bf16_weights(tensors):
    """The release stream of (name, tensor) with every FP8 / FP4 linear replaced by BF16 holding exactly
    its dequantized value, no `.scale` (Engram tables keep FP8 + scale, as in the release)."""
    from deepinfer.kernels import dequant_fp4_ref
    pending = None
    for name, t in tensors:
        if pending is not None:
            wname, w = pending
            pending = None
            if name == wname[: -len(".weight")] + ".scale":
                e = t.view(torch.uint8).to(torch.int32) - 127
                if w.dtype == torch.int8:                                   # FP4: scale per (row, 32)
                    yield wname, dequant_fp4_ref(w, t.view(torch.uint8)).to(torch.bfloat16)
                else:                                                       # FP8: scale per 32x32 tile
                    n, k = w.shape
                    sc = torch.exp2(e.double()).repeat_interleave(32, 0)[:n].repeat_interleave(32, 1)[:, :k]
                    yield wname, (w.double() * sc).to(torch.bfloat16)
                continue
            yield wname, w
        if name.endswith(".weight") and t.dtype in (torch.float8_e4m3fn, torch.int8) and "engram.embed" not in name:
            pending = (name, t)
            continue
        yield name, t
    if pending is not None:
        yield pending


# ---- quantizers (release formats) ----------------------------------------------------------
def _pow2_exponent(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """Smallest e with amax / 2^e <= qmax."""
    e = torch.ceil(torch.log2(amax.double().clamp_min(1e-30) / qmax))
    return e.clamp(-127, 127).to(torch.int32)


def _e8m0(e: torch.Tensor) -> torch.Tensor:
    return (e + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def quant_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> e4m3 [N, K] + E8M0 [ceil(N/32), ceil(K/32)] (one power-of-two scale per 32x32 tile)."""
    n, k = w.shape
    pn, pk = -n % 32, -k % 32
    g = torch.nn.functional.pad(w.float(), (0, pk, 0, pn)).view((n + pn) // 32, 32, (k + pk) // 32, 32)
    e = _pow2_exponent(g.abs().amax(dim=(1, 3)), 448.0)
    q = (g / torch.exp2(e.float())[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q.view(n + pn, k + pk)[:n, :k].contiguous(), _e8m0(e)


def quant_fp8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = w.shape
    g = w.float().view(n, k // 32, 32)
    e = _pow2_exponent(g.abs().amax(-1), 448.0)
    q = (g / torch.exp2(e.float())[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q.view(n, k), _e8m0(e)


_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def quant_fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> I8 [N, K/2] packed e2m1 (element 2j low nibble) + E8M0 [N, K/32]."""
    n, k = w.shape
    g = w.float().view(n, k // 32, 32)
    e = _pow2_exponent(g.abs().amax(-1), 6.0)
    v = e2m1_round((g / torch.exp2(e.float())[..., None]).clamp(-6, 6))
    code = torch.bucketize(v.abs(), _GRID)          # exact grid values -> their index
    code = (code | ((v < 0).to(torch.int64) << 3)).view(n, k).to(torch.uint8)
    return (code[:, 0::2] | (code[:, 1::2] << 4)).view(torch.int8), _e8m0(e)


def direct_fp4(gen: torch.Generator, n: int, k: int, std: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniform random nibbles (mean-square code value 11.3125) with one scale giving std ~ `std`."""
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen).view(torch.int8)
    e = round(math.log2(std / math.sqrt(11.3125)))
    return packed, _e8m0(torch.full((n, k // 32), e, dtype=torch.int32))


# ---- tensor generation -------------------------------------------------------------------------
class _Draw:
    def __init__(self, seed: int):
        self.seed = seed

    def gen(self, name: str) -> torch.Generator:
        return torch.Generator().manual_seed((self.seed * 1_000_003 + zlib.crc32(name.encode())) % (1 << 63))

    def normal(self, name: str, shape, std=1.0, mean=0.0) -> torch.Tensor:
        return torch.randn(shape, generator=self.gen(name)) * std + mean

    def uniform(self, name: str, shape, lo, hi) -> torch.Tensor:
        return torch.rand(shape, generator=self.gen(name)) * (hi - lo) + lo


def layer_tensors(tc: dict, p: str, layer: int, draw: _Draw, backbone: bool):
    """Yield (name, tensor) of one block, release dtypes."""
    d, H, hd, qr = tc["hidden_size"], tc["num_attention_heads"], tc["head_dim"], tc["q_lora_rank"]
    inter, hc, G, orank = tc["moe_intermediate_size"], tc["hc_mult"], tc["o_groups"], tc["o_lora_rank"]
    mix = (2 + hc) * hc

    def fp8(name, n, k, std=None):
        q, s = quant_fp8(draw.normal(name + ".weight", (n, k), std if std is not None else k ** -0.5))
        return [(name + ".weight", q), (name + ".scale", s)]

    def norm(name, n):
        return [(name, draw.normal(name, (n,), 0.1, 1.0).to(torch.bfloat16))]

    def bf16(name, shape, std):
        return [(name, draw.normal(name, shape, std).to(torch.bfloat16))]

    out = norm(p + "attn_norm.weight", d) + norm(p + "ffn_norm.weight", d)
    for sub in ("attn", "ffn"):
        base = draw.normal(f"{p}hc_{sub}_base", (mix,), 0.5)
        base[hc:2 * hc] += INIT["post_base"]
        base[2 * hc:] += INIT["comb_diag"] * torch.eye(hc).flatten()
        out += [(f"{p}hc_{sub}_fn", draw.normal(f"{p}hc_{sub}_fn", (mix, hc * d), (hc * d) ** -0.5)),
                (f"{p}hc_{sub}_base", base), (f"{p}hc_{sub}_scale", draw.uniform(f"{p}hc_{sub}_scale", (3,), 0.5, 1.5))]
    a = p + "attn."
    out += [(a + "attn_sink", draw.normal(a + "attn_sink", (H,)))]
    out += fp8(a + "wq_a", qr, d) + norm(a + "q_norm.weight", qr) + fp8(a + "wq_b", H * hd, qr)
    out += fp8(a + "wkv", hd, d) + norm(a + "kv_norm.weight", hd)
    out += fp8(a + "wo_a", G * orank, H * hd // G) + fp8(a + "wo_b", d, G * orank)
    if backbone and layer in tc["kv_source_layer_ids"]:
        out += bf16(a + "compressor.wkv.weight", (hd, d), d ** -0.5)
        if tc["compress_ratios"][layer] > 1:
            out += bf16(a + "compressor.wgate.weight", (hd, d), 2 * d ** -0.5)
        out += norm(a + "compressor.norm.weight", hd)
    if backbone and layer in tc["index_source_layer_ids"]:
        ih, ihd = tc["index_n_heads"], tc["index_head_dim"]
        out += fp8(a + "indexer.wq_b", ih * ihd, qr) + bf16(a + "indexer.weights_proj.weight", (ih, d), d ** -0.5)
        if layer in tc["kv_source_layer_ids"]:
            out += bf16(a + "indexer.wk.weight", (ihd, hd), hd ** -0.5) + norm(a + "indexer.k_norm.weight", ihd)
    f = p + "ffn."
    n_exp = tc["n_routed_experts"] if backbone else tc["dspark_n_routed_experts"]
    out += bf16(f + "gate.weight", (n_exp, d), d ** -0.5)
    out += [(f + "gate.bias", draw.normal(f + "gate.bias", (n_exp,), INIT["gate_bias_std"])),
            (f + "gate.bias_vl", draw.normal(f + "gate.bias_vl", (n_exp,), INIT["gate_bias_std"]))]
    yield from out
    s = INIT["expert_spread"]
    for w, (n, k) in (("w1", (inter, d)), ("w3", (inter, d)), ("w2", (d, inter))):
        common = draw.normal(f"{f}experts.common.{w}", (n, k), k ** -0.5) if n * k <= DIRECT_FP4_NUMEL else None
        for e in range(n_exp):
            name = f"{f}experts.{e}.{w}"
            if common is None:
                q, sc = direct_fp4(draw.gen(name), n, k, k ** -0.5)
            else:
                q, sc = quant_fp4(math.sqrt(1 - s * s) * common + s * draw.normal(name + ".weight", (n, k), k ** -0.5))
            yield name + ".weight", q
            yield name + ".scale", sc
    for w, (n, k) in (("w1", (inter, d)), ("w3", (inter, d)), ("w2", (d, inter))):
        yield from fp8(f"{f}shared_experts.{w}", n, k)
    if backbone and layer in tc["engram_layer_ids"]:
        li = tc["engram_layer_ids"].index(layer)
        rows, ehd = tc["engram_num_embeddings"][li], tc["engram_head_dim"]
        cols = (tc["engram_max_ngram_size"] - 1) * tc["engram_n_heads"]
        en = p + "engram."
        q, sc = quant_fp8_rows(draw.normal(en + "embed.weight", (rows, ehd)))
        yield en + "embed.weight", q
        yield en + "embed.scale", sc
        yield from fp8(en + "wkv", d * (hc + 1), cols * ehd)
        yield en + "q_weight", draw.normal(en + "q_weight", (hc, d), 0.3, 1.0).to(torch.bfloat16)
        yield en + "k_weight", draw.normal(en + "k_weight", (hc, d), 0.3, 1.0).to(torch.bfloat16)


def top_tensors(tc: dict, draw: _Draw, which: str):
    d, V = tc["hidden_size"], tc["vocab_size"]
    if which == "embed":
        yield "embed.weight", draw.normal("embed.weight", (V, d)).to(torch.bfloat16)
        return
    yield "norm.weight", draw.normal("norm.weight", (d,), 0.1, 1.0).to(torch.bfloat16)
    head = draw.normal("head.weight", (V, d), INIT["head_std"] * d ** -0.5)
    rn = torch.exp(INIT["head_norm_sigma"] * draw.normal("head.row_norm", (V,)))
    rn = rn.clamp(max=5.0 * rn.square().mean().sqrt())
    yield "head.weight", (head * (rn / rn.square().mean().sqrt())[:, None]).to(torch.bfloat16)


def vision_tensors(tc: dict, vc: dict, draw: _Draw):
    """The vision tower in release names, all BF16: linears ~ N(0, 1/fan_in), small biases, norms ~ 1,
    span vectors at the embedding scale."""
    from deepinfer.model.loader import vision_tensors as names
    from deepinfer.model.vision import VisionArgs
    from deepinfer.model.args import ModelArgs
    args = ModelArgs(dim=tc["hidden_size"], vision=VisionArgs.from_hf(vc))
    for name, (kind, shape) in names(args).items():
        if kind == "norm":
            t = draw.normal(name, shape, 0.1, 1.0)
        elif name.endswith(".bias"):
            t = draw.normal(name, shape, 0.02)
        elif len(shape) == 1:                   # image_start / image_end / image_newline
            t = draw.normal(name, shape)
        else:
            t = draw.normal(name, shape, shape[1] ** -0.5)
        yield name, t.to(torch.bfloat16)


def mtp_tensors(tc: dict, j: int, draw: _Draw):
    n, d, r = tc["num_hidden_layers"], tc["hidden_size"], tc["dspark_markov_rank"]
    p = f"mtp.{j}."
    yield from layer_tensors(tc, p, n + j, draw, backbone=False)
    if j == 0:
        k = d * len(tc["dspark_target_layer_ids"])
        q, s = quant_fp8(draw.normal(p + "main_proj.weight", (d, k), k ** -0.5))
        yield p + "main_proj.weight", q
        yield p + "main_proj.scale", s
        yield p + "main_norm.weight", draw.normal(p + "main_norm.weight", (d,), 0.1, 1.0).to(torch.bfloat16)
    if j == tc["num_nextn_predict_layers"] - 1:
        V = tc["vocab_size"]
        yield p + "norm.weight", draw.normal(p + "norm.weight", (d,), 0.1, 1.0).to(torch.bfloat16)
        yield p + "markov_head.embed.weight", draw.normal(p + "markov_head.embed.weight", (V, r)).to(torch.bfloat16)
        yield p + "markov_head.head.weight", draw.normal(p + "markov_head.head.weight", (V, r), r ** -0.5).to(torch.bfloat16)
        yield p + "confidence_head.proj.weight", draw.normal(p + "confidence_head.proj.weight", (1, d + r),
                                                             0.4 * (d + r) ** -0.5).to(torch.bfloat16)


def make_checkpoint(preset: str | dict, seed: int, out: str | Path, progress: bool = True,
                    weights: str = "release") -> Path:
    """Write the checkpoint folder of a preset name or a custom config (text_config); returns it.
    Shards are flushed as they fill (bounded memory). weights "bf16": every linear stored as BF16
    holding the release weight's exact value (as_bf16_weights), no quantization_config."""
    from safetensors.torch import save_file

    if isinstance(preset, str) and preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}: one of {', '.join(PRESETS)}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tc = text_config(preset)
    draw = _Draw(seed)
    groups = [lambda: top_tensors(tc, draw, "embed")]
    groups += [lambda L=L: layer_tensors(tc, f"layers.{L}.", L, draw, True) for L in range(tc["num_hidden_layers"])]
    groups += [lambda j=j: mtp_tensors(tc, j, draw) for j in range(tc["num_nextn_predict_layers"])]
    groups += [lambda: top_tensors(tc, draw, "head")]
    vc = VISION.get(preset) if isinstance(preset, str) else None    # custom configs: text only
    if vc is not None:
        groups.append(lambda: vision_tensors(tc, vc, draw))
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(groups), desc=f"writing {preset if isinstance(preset, str) else 'custom'}",
                   unit="group", leave=False)
    shards, cur, cur_bytes = [], {}, 0

    def flush():
        nonlocal cur, cur_bytes
        if cur:
            tmp = out / f".shard-{len(shards):05d}.safetensors"
            save_file(cur, str(tmp), metadata={"format": "pt"})
            shards.append((tmp, list(cur)))
            cur, cur_bytes = {}, 0

    for g in groups:
        for name, t in (g() if weights == "release" else as_bf16_weights(g())):
            cur[name] = t.contiguous()
            cur_bytes += t.numel() * t.element_size()
            if cur_bytes >= SHARD_BYTES:
                flush()
        if bar is not None:
            bar.update(1)
    flush()
    if bar is not None:
        bar.close()
    weight_map, total = {}, 0
    for i, (tmp, names) in enumerate(shards):
        fn = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        os.replace(tmp, out / fn)
        os.chmod(out / fn, 0o644)
        total += (out / fn).stat().st_size
        weight_map.update({n: fn for n in names})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}, indent=2))
    (out / "config.json").write_text(json.dumps(hf_config(tc, vc, weights), indent=2, ensure_ascii=False))
    write_tokenizer(out / "tokenizer.json")
    return out
