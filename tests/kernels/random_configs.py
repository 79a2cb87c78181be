"""Random valid small V4.1 configs, and the fast path against the torch references on each.

`draw_config(seed)` draws a text_config (deepinfer/checkpoint/generator.py writes its release-format
checkpoint): layer roles and their order (window-only, ratio-2/4 KV + index sources and their
reusers, re-indexers, a ratio-1 candidate source), head counts, o_groups and rows per group (also
fewer than 32, the `wo_a` case of issue 15), index heads / top-k, candidate blocks, expert counts,
hc, window, Engram and DSpark layers, with widths that are not multiples of the kernels' tiles.

`compare(model, prompt, chunks, decode)` runs one sequence through whole or chunked prefill and
teacher-forced decode with kernels/select.py on the fast paths and again on the references, on the
same loaded model, and scores the logits as ../shared/tools/check-parity does (err = max |fast - ref|
over the reference's top 512, in units of the reference row's std).

    TRITON_INTERPRET=1 DEEPINFER_KERNELS=fast python tests/kernels/random_configs.py SEED [SEED ...]
        the same check on a CPU through Triton's interpreter (CI runs two tiny seeds this way)
"""

from __future__ import annotations

import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

# the shared fixtures' rules (../shared/fixtures/v41-tiny{-bf16,}/pass_rule.json), used when absent: a
# bf16-weight config is judged by the bf16 fixture's rule, a release-dtype one (FP8 linears, FP4 experts:
# every linear re-rounds its input, chaotic at the last bit) by the release fixture's
BF16_RULE = dict(median_err=0.307, max_err=4.21, min_top1=0.912, top1_guard=0.25)
RELEASE_RULE = dict(median_err=0.884, max_err=3.48, min_top1=0.794, top1_guard=2.21)
# Triton's interpreter truncates float -> bf16 casts where a GPU rounds (fast_model_smoke.py measured
# 0.33-0.39 std on v41-tiny-bf16; 0.6 here on a 2-layer hc 1 config): a dispatch-and-shapes check only
INTERPRETER_RULE = dict(median_err=1.0, max_err=2.5, min_top1=0.75, top1_guard=1.0)


def fixture_rule(weights: str, shared: Path | None = None) -> dict:
    """The pass rule of the shared fixture of this weight kind ("bf16" or "release")."""
    default = BF16_RULE if weights == "bf16" else RELEASE_RULE
    p = (shared or Path()) / "fixtures" / ("v41-tiny-bf16" if weights == "bf16" else "v41-tiny") / "pass_rule.json"
    if shared is not None and p.is_file():
        r = json.loads(p.read_text())
        return {k: r[k] for k in default}
    return dict(default)


def weight_kind(seed: int) -> str:
    """Seeds 0, 1 mod 4: bf16 weights; 2, 3: release dtypes (3 also forces the opt-in prefill paths)."""
    return "bf16" if seed % 4 < 2 else "release"


def _roles(rng: random.Random, n_layers: int) -> dict:
    """compress_ratios and the source layers: window-only layers first, then up to two compressed
    segments (a ratio-2 or -4 'encoder', then a ratio-1 'decoder'), each led by a KV + index source;
    the rest of a segment reuses it, or re-indexes (own indexer over the source's keys)."""
    n_win = rng.randint(0, min(2, n_layers - 1))
    rest = n_layers - n_win
    n_enc = rng.randint(0, rest)
    ratios = [0] * n_win + [rng.choice([2, 2, 4])] * n_enc + [1] * (rest - n_enc)
    kv, idx, cand = [], [], -1
    for start, length in ((n_win, n_enc), (n_win + n_enc, rest - n_enc)):
        if length == 0:
            continue
        kv.append(start)
        idx.append(start)
        if ratios[start] == 1 and rng.random() < 0.7:
            cand = start
        idx += [L for L in range(start + 1, start + length) if rng.random() < 0.4]
    return dict(compress_ratios=ratios, kv_source_layer_ids=kv, index_source_layer_ids=sorted(idx),
                candidate_source_layer_id=cand)


def draw_config(seed: int, tiny: bool = False) -> dict:
    """A valid text_config (keys over generator.COMMON). tiny: the smallest widths (interpreter runs)."""
    rng = random.Random(seed)
    n_layers = rng.randint(2, 4 if tiny else 6)
    roles = _roles(rng, n_layers)
    heads = rng.choice([1, 2, 3, 4, 6])
    groups = rng.choice([g for g in (1, 2, 3, 4, 6) if heads % g == 0])
    head_dim = rng.choice([32, 64] if tiny else [32, 64, 96, 160])
    n_exp = rng.randint(2, 6 if tiny else 12)
    n_mtp = rng.choice([0, 1, 2])
    tc = dict(
        hidden_size=rng.choice([32, 64] if tiny else [32, 64, 96, 128, 160, 224, 256]),
        moe_intermediate_size=rng.choice([32, 64, 96] if tiny else [32, 64, 96, 128, 256]),
        num_attention_heads=heads, head_dim=head_dim,
        qk_rope_head_dim=rng.choice([8, 16, 16, 24] if head_dim > 32 else [8, 16]),
        q_lora_rank=rng.choice([32, 64, 96]), o_groups=groups,
        # wo_b's K = o_groups * o_lora_rank is act-quantized per 32; rows per group need not be
        o_lora_rank=rng.choice([r for r in (8, 16, 24, 32, 48, 64) if groups * r % 32 == 0]),
        n_routed_experts=n_exp, num_experts_per_tok=rng.randint(1, min(n_exp, 4)),
        index_n_heads=rng.choice([1, 2, 4, 8]), index_head_dim=rng.choice([32, 64]),
        index_topk=rng.choice([8, 16, 24, 40]),
        candidate_topk_blocks=rng.choice([2, 3, 8, 16]), candidate_block_size=rng.choice([2, 4, 8]),
        hc_mult=rng.choice([1, 2, 3, 4, 4]), sliding_window=rng.choice([32, 64, 128, 128]),
        engram_layer_ids=sorted(rng.sample(range(n_layers), rng.randint(0, min(2, n_layers)))),
        engram_vocab_size=rng.choice([300, 1000]), engram_n_heads=rng.choice([1, 2, 3]),
        engram_head_dim=rng.choice([32, 64]),
        num_nextn_predict_layers=n_mtp, dspark_block_size=5 if n_mtp else 0,
        dspark_target_layer_ids=sorted(rng.sample(range(n_layers), rng.randint(1, min(3, n_layers)))),
        dspark_markov_rank=rng.choice([8, 16]), dspark_n_routed_experts=rng.randint(2, 4),
        dspark_num_experts_per_tok=rng.randint(1, 2),
        **roles,
    )
    tc["compress_ratios"] = tc["compress_ratios"] + [0] * n_mtp
    return tc


def describe(tc: dict) -> str:
    keys = ("hidden_size", "num_attention_heads", "head_dim", "qk_rope_head_dim", "o_groups", "o_lora_rank",
            "q_lora_rank", "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok", "hc_mult",
            "sliding_window", "index_n_heads", "index_head_dim", "index_topk", "candidate_source_layer_id",
            "compress_ratios", "kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids",
            "num_nextn_predict_layers")
    return " ".join(f"{k}={tc[k]}" for k in keys)


def write_checkpoint(tc: dict, seed: int, out: Path, weights: str = "release") -> Path:
    from deepinfer.checkpoint.generator import make_checkpoint
    return make_checkpoint(tc, seed, out, progress=False, weights=weights)


@dataclass
class Scores:
    errs: list[float]           # per logits row: max |fast - ref| over the ref's top 512 / ref std
    top1_same: int
    rows: int
    guarded_flips: int          # top-1 differs where the ref's top1-top2 margin >= the rule's guard

    def __add__(self, o: "Scores") -> "Scores":
        return Scores(self.errs + o.errs, self.top1_same + o.top1_same, self.rows + o.rows,
                      self.guarded_flips + o.guarded_flips)

    def judge(self, rule: dict) -> list[str]:
        errs = sorted(self.errs)
        med, mx = errs[len(errs) // 2], errs[-1]
        fails = []
        if mx >= rule["max_err"]:
            fails.append(f"max err {mx:.3g} >= {rule['max_err']}")
        if med >= rule["median_err"]:
            fails.append(f"median err {med:.3g} >= {rule['median_err']}")
        if self.top1_same < rule["min_top1"] * self.rows:
            fails.append(f"top-1 {self.top1_same}/{self.rows} < {rule['min_top1']}")
        if self.guarded_flips:
            fails.append(f"{self.guarded_flips} top-1 flips above the {rule['top1_guard']} std guard")
        return fails

    def line(self) -> str:
        errs = sorted(self.errs)
        return (f"rows {self.rows} err median {errs[len(errs) // 2]:.3g} max {errs[-1]:.3g} "
                f"top-1 {self.top1_same}/{self.rows}")


def score(fast: torch.Tensor, ref: torch.Tensor, guard: float, k: int = 512) -> Scores:
    """fast, ref [R, V] fp32 logits."""
    fast, ref = fast.double().cpu(), ref.double().cpu()
    std = ref.std(-1).clamp_min(1e-30)
    top = ref.topk(min(k, ref.shape[-1]), -1)
    err = ((fast.gather(-1, top.indices) - top.values).abs().amax(-1) / std).tolist()
    same = fast.argmax(-1) == top.indices[:, 0]
    margin = (top.values[:, 0] - top.values[:, 1]) / std
    return Scores(err, int(same.sum()), len(err), int((~same & (margin >= guard)).sum()))


def run_schedule(model, prompt: list[int], chunks: list[int], decode: list[int]) -> torch.Tensor:
    """Prefill `prompt` in chunks of the given sizes, then feed `decode` one token at a time; the
    logits of every 16th prompt position, each chunk's last, and each decode step, [R, V] fp32."""
    from deepinfer.model.simple import SequenceRunner
    r = SequenceRunner(model, max_len=len(prompt) + len(decode) + 8)
    rows, pos = [], 0
    for c in chunks:
        out = r.step(prompt[pos:pos + c], logits="all").logits
        keep = [i for i in range(c) if (pos + i) % 16 == 0 or i == c - 1]
        rows.append(out[keep].float())
        pos += c
    for t in decode:
        rows.append(r.step([t]).logits.float())
    return torch.cat(rows)


def set_kernels(mode: str) -> None:
    from deepinfer.kernels import select
    select.KERNELS = mode
    select._fast_ok.cache_clear()


def compare(model, prompt, chunks, decode, guard: float) -> Scores:
    set_kernels("fast")
    fast = run_schedule(model, prompt, chunks, decode)
    set_kernels("ref")
    try:
        ref = run_schedule(model, prompt, chunks, decode)
    finally:
        set_kernels("fast")
    return score(fast, ref, guard)


def schedules(seed: int, prompt_len: int) -> dict[str, list[int]]:
    """Whole prefill, and a chunked prefill of random chunk sizes (some not multiples of anything)."""
    rng = random.Random(seed + 1)
    chunks, left = [], prompt_len
    while left:
        c = min(left, rng.choice([1, 17, 33, 64, 100, 100]))
        chunks.append(c)
        left -= c
    return {"prefill": [prompt_len], "chunked": chunks}


def prefill_paths_for_small_steps(seed: int, log=print) -> None:
    """Release-dtype odd seeds: the opt-in prefill paths on these short prompts, which real prompts take
    from 512 rows / 4096 token-expert pairs: seed % 8 == 3 the FP8 x FP8 GEMMs from 16 rows and the MoE's
    contiguous form on them from 64 pairs (where K % 128 == 0), seed % 8 == 7 the MoE's contiguous form on
    the W8A16 kernel from 64 pairs. Restored by set_prefill_defaults."""
    from deepinfer.kernels import select
    from deepinfer.model import moe
    fp8 = seed % 8 == 3
    select.PREFILL_GEMM, select.FP8_PREFILL_MIN_M, moe.MASKED_MAX_PAIRS = ("fp8" if fp8 else "w8a16"), 16, 64
    select.MOE_CONTIGUOUS = not fp8
    log("  (FP8 prefill GEMMs from 16 rows, MoE contiguous form from 64 pairs)" if fp8 else
        "  (MoE contiguous form on W8A16 from 64 pairs)")


def set_prefill_defaults(defaults: tuple) -> None:
    from deepinfer.kernels import select
    from deepinfer.model import moe
    select.PREFILL_GEMM, select.FP8_PREFILL_MIN_M, moe.MASKED_MAX_PAIRS, select.MOE_CONTIGUOUS = defaults


def check_config(seed: int, workdir: Path, device: str, rule: dict | None = None, tiny: bool = False,
                 prompt_len: int | None = None, n_decode: int = 4, log=print, only: tuple[str, ...] = ("prefill", "chunked"),
                 shared: Path | None = None) -> list[str]:
    """Write config `seed`'s checkpoint (weight_kind(seed)), load it on `device` (the CUDA defaults:
    FP8 linears, FP4 or FP8 expert stacks, fused linears, FP8 wo_a blocks), compare fast vs reference on
    whole and chunked prefill with teacher-forced decode after each, and judge every logits row of
    both by the rule (default: the fixture rule of the weight kind). Returns the failures."""
    from deepinfer.model.loader import load_model
    tc = draw_config(seed, tiny)
    weights = "release" if tiny else weight_kind(seed)
    rule = rule or fixture_rule(weights, shared)
    log(f"config {seed} ({weights} weights): {describe(tc)}")
    ckpt = write_checkpoint(tc, seed, workdir / f"cfg{seed}", weights)
    cuda_forms = dict(fuse_linears=True, wo_a_fp8=True, expert_row_scales=True)   # CUDA's defaults, on a CPU too
    # the engine's CUDA default holds the experts as FP4 stacks (EngineArgs.expert_format="auto"); half the
    # configs take them, half the FP8 stacks (batch-invariant mode, DeepGEMM)
    expert_format = "fp4" if device == "cuda" and (seed // 2) % 2 == 0 else "fp8"
    log(f"  experts in {expert_format} stacks")
    model = load_model(ckpt, device=device, progress=False, weight_format="fp8", expert_format=expert_format,
                       **cuda_forms)
    rng = random.Random(seed)
    n = prompt_len or rng.randint(90, 240)
    prompt = [rng.randrange(1000, 120000) for _ in range(n)]
    decode = [rng.randrange(1000, 120000) for _ in range(n_decode)]
    if device == "cuda" and seed % 2 and weights == "release":
        prefill_paths_for_small_steps(seed, log)
    total = None
    for name, chunks in schedules(seed, n).items():
        if name not in only:
            continue
        s = compare(model, prompt, chunks, decode, rule["top1_guard"])
        log(f"  {name:8s} chunks {len(chunks):3d}: {s.line()}")
        total = s if total is None else total + s
    fails = total.judge(rule)
    log(f"  both: {total.line()} {'PASS' if not fails else 'FAIL ' + '; '.join(fails)}")
    del model
    return fails


def prefill_defaults() -> tuple:
    from deepinfer.kernels import select
    from deepinfer.model import moe
    return select.PREFILL_GEMM, select.FP8_PREFILL_MIN_M, moe.MASKED_MAX_PAIRS, select.MOE_CONTIGUOUS


def main(seeds: list[int]) -> int:
    import os
    import tempfile
    assert os.environ.get("TRITON_INTERPRET") == "1" and os.environ.get("DEEPINFER_KERNELS") == "fast"
    torch.manual_seed(0)
    bad = 0
    with tempfile.TemporaryDirectory() as d:
        for s in seeds:
            bad += bool(check_config(s, Path(d), "cpu", INTERPRETER_RULE, tiny=True, prompt_len=45, n_decode=2,
                                     only=("chunked",)))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main([int(a) for a in sys.argv[1:]]))
