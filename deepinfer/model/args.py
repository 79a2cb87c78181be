"""ModelArgs: the V4.1 model shape, field names as the reference's inference/config.json keys.

`ModelArgs.from_hf_config(cfg)` reads a release-style HF `config.json` (top level + `text_config`),
`ModelArgs.from_checkpoint(dir)` reads it from a checkpoint folder. The weight kind (`dtype`,
`expert_dtype`) comes from `quantization_config`: absent means BF16 weights (plain BF16 GEMMs, no
activation rounding). Errors name the offending field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path


class ConfigError(ValueError):
    """A config.json that does not describe a DeepSeek-V4.1 text model we can run."""


@dataclass
class ModelArgs:
    vocab_size: int = 129280
    dim: int = 5120
    moe_inter_dim: int = 2304
    n_layers: int = 40
    n_mtp_layers: int = 3
    n_heads: int = 64
    n_routed_experts: int = 384
    n_shared_experts: int = 1
    n_activated_experts: int = 6
    score_func: str = "sqrtsoftplus"
    gate_temp: float = 1.0
    norm_topk_prob: bool = True
    route_scale: float = 1.5
    swiglu_limit: float = 10.0
    q_lora_rank: int = 1280
    head_dim: int = 512
    rope_head_dim: int = 64
    norm_eps: float = 1e-20
    o_groups: int = 8
    o_lora_rank: int = 1024
    window_size: int = 128
    compress_ratios: tuple[int, ...] = ()
    kv_source_layers: tuple[int, ...] = ()
    index_source_layers: tuple[int, ...] = ()
    compress_rope_theta: float = 160000.0
    original_seq_len: int = 65536
    rope_theta: float = 10000.0
    rope_factor: float = 16.0
    beta_fast: float = 32
    beta_slow: float = 1
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    candidate_source_layer: int = -1
    candidate_topk_blocks: int = 0
    candidate_block_size: int = 0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    engram_layer_ids: tuple[int, ...] = ()
    engram_num_embeddings: tuple[int, ...] = ()
    engram_max_ngram_size: int = 4
    engram_vocab_size: int = 0
    engram_n_heads: int = 0
    engram_head_dim: int = 0
    engram_pad_id: int = 2
    engram_compressed_vocab_size: int = 0
    image_token_id: int = 129264
    vision: "VisionArgs | None" = None   # the vision tower (HF `vision_config`); None = text-only
    dspark_block_size: int = 0
    dspark_noise_token_id: int = 128799
    dspark_target_layer_ids: tuple[int, ...] = ()
    dspark_markov_rank: int = 256
    dspark_n_routed_experts: int = 0
    dspark_n_activated_experts: int = 0
    dtype: str = "fp8"                 # "fp8" (release) or "bf16" (weights stored as BF16)
    expert_dtype: str | None = "fp4"
    # NOTE(model): runtime switch, not a config key. The reference's decode path lets a ratio-2
    # index-key owner whose group is still open score against whichever owner published index keys
    # last (model.py Indexer: `shared_attn.index_k` is not republished). False = every indexer uses
    # its own KV source's keys (the intended semantics).
    emulate_index_k_alias: bool = False
    # NOTE(model): runtime switch. Two things make a token's numbers depend on the step it ran in:
    # the reference lays out a chunk that starts at 0 with window keys first and pads after
    # (prefill), any later chunk with pads first (decode), and the blockwise softmax rounds
    # differently in the two; and the MoE runs small steps grouped, large ones expert by expert
    # (other GEMM operand layouts). True = the decode layout for every chunk and the per-expert MoE
    # for every step, so a prompt's logits do not depend on where the scheduler cut it (the engine's
    # batch-invariant mode sets it).
    step_shape_invariant: bool = False
    # NOTE(model): runtime switch (EngineArgs(model_overrides={"index_k_packed": False}) restores bf16 keys).
    # The cache holds the index keys as packed FP4 rows (reference.fp4_pack_rows_ref: their values exactly,
    # 80 bytes a 128-value key against 256 in bf16; the score kernels unpack them to the same bits): about a
    # sixth of an indexer source's compressed pool saved, and the decode step 1.006x / 1.018x at batch 64 /
    # 128 (H100, 2026-12-05, evening, two runs in either order; perf/H200_NOTES.md).
    index_k_packed: bool = True
    extra: dict = field(default_factory=dict, repr=False)

    # ---- derived layer roles -------------------------------------------------------------
    @property
    def n_total_layers(self) -> int:
        return self.n_layers + (self.n_mtp_layers if self.dspark_block_size else 0)

    def kv_source_of(self, layer_id: int) -> int:
        """The KV source whose compressed cache `layer_id` reads (the latest source at or before it)."""
        srcs = [s for s in self.kv_source_layers if s <= layer_id]
        return srcs[-1] if srcs else -1

    def index_source_of(self, layer_id: int) -> int:
        srcs = [s for s in self.index_source_layers if s <= layer_id]
        return srcs[-1] if srcs else -1

    def get_moe_config(self, layer_id: int) -> tuple[int, int]:
        if layer_id < self.n_layers:
            return self.n_routed_experts, self.n_activated_experts
        return (self.dspark_n_routed_experts or self.n_routed_experts,
                self.dspark_n_activated_experts or self.n_activated_experts)

    @property
    def n_hash_cols(self) -> int:
        return (self.engram_max_ngram_size - 1) * self.engram_n_heads

    # ---- loading ---------------------------------------------------------------------------
    @classmethod
    def from_checkpoint(cls, ckpt_dir: str | Path, **overrides) -> "ModelArgs":
        path = Path(ckpt_dir) / "config.json"
        if not path.is_file():
            raise ConfigError(f"{path}: missing (a checkpoint folder needs an HF config.json)")
        try:
            cfg = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        return cls.from_hf_config(cfg, **overrides)

    @classmethod
    def from_hf_config(cls, cfg: dict, **overrides) -> "ModelArgs":
        mt = cfg.get("model_type")
        if mt != "deepseek_v41":
            raise ConfigError(f"config.json field 'model_type' is {mt!r}: expected 'deepseek_v41' "
                              "(DeepSeek-V4.1-Flash); another model family cannot be loaded")
        tc = cfg.get("text_config")
        if not isinstance(tc, dict):
            raise ConfigError("config.json field 'text_config' is missing")
        if tc.get("model_type", "deepseek_v41_text") != "deepseek_v41_text":
            raise ConfigError(f"config.json field 'text_config.model_type' is {tc.get('model_type')!r}: "
                              "expected 'deepseek_v41_text'")

        def req(key):
            if key not in tc:
                raise ConfigError(f"config.json field 'text_config.{key}' is missing")
            return tc[key]

        rs = tc.get("rope_scaling") or {}
        q = cfg.get("quantization_config")
        n_layers = req("num_hidden_layers")
        n_mtp = tc.get("num_nextn_predict_layers", 0)
        ratios = tuple(req("compress_ratios"))
        if len(ratios) != n_layers + n_mtp:
            raise ConfigError(f"config.json field 'text_config.compress_ratios' has {len(ratios)} entries: "
                              f"expected num_hidden_layers + num_nextn_predict_layers = {n_layers + n_mtp}")
        if q is not None:
            wbs = q.get("weight_block_size", [32, 32])
            if list(wbs) != [32, 32]:
                raise ConfigError(f"config.json field 'quantization_config.weight_block_size' is {wbs}: "
                                  "V4.1 uses [32, 32]")
        args = cls(
            vocab_size=req("vocab_size"), dim=req("hidden_size"), moe_inter_dim=req("moe_intermediate_size"),
            n_layers=n_layers, n_mtp_layers=n_mtp, n_heads=req("num_attention_heads"),
            n_routed_experts=req("n_routed_experts"), n_shared_experts=tc.get("n_shared_experts", 1),
            n_activated_experts=req("num_experts_per_tok"), score_func=tc.get("scoring_func", "sqrtsoftplus"),
            gate_temp=tc.get("gate_temp", 1.0), norm_topk_prob=tc.get("norm_topk_prob", True),
            route_scale=tc.get("routed_scaling_factor", 1.0), swiglu_limit=tc.get("swiglu_limit", 0.0),
            q_lora_rank=req("q_lora_rank"), head_dim=req("head_dim"), rope_head_dim=req("qk_rope_head_dim"),
            norm_eps=tc.get("rms_norm_eps", 1e-20), o_groups=req("o_groups"), o_lora_rank=req("o_lora_rank"),
            window_size=req("sliding_window"), compress_ratios=ratios,
            kv_source_layers=tuple(tc.get("kv_source_layer_ids", ())),
            index_source_layers=tuple(tc.get("index_source_layer_ids", ())),
            compress_rope_theta=tc.get("compress_rope_theta", 160000.0),
            original_seq_len=rs.get("original_max_position_embeddings", 0),
            rope_theta=tc.get("rope_theta", 10000.0), rope_factor=rs.get("factor", 1.0),
            beta_fast=rs.get("beta_fast", 32), beta_slow=rs.get("beta_slow", 1),
            index_n_heads=tc.get("index_n_heads", 0), index_head_dim=tc.get("index_head_dim", 0),
            index_topk=tc.get("index_topk", 0),
            candidate_source_layer=tc.get("candidate_source_layer_id", -1)
            if tc.get("candidate_source_layer_id") is not None else -1,
            candidate_topk_blocks=tc.get("candidate_topk_blocks", 0),
            candidate_block_size=tc.get("candidate_block_size", 0),
            hc_mult=req("hc_mult"), hc_sinkhorn_iters=tc.get("hc_sinkhorn_iters", 20), hc_eps=tc.get("hc_eps", 1e-6),
            engram_layer_ids=tuple(tc.get("engram_layer_ids", ())),
            engram_num_embeddings=tuple(tc.get("engram_num_embeddings", ())),
            engram_max_ngram_size=tc.get("engram_max_ngram_size", 1),
            engram_vocab_size=tc.get("engram_vocab_size", 0), engram_n_heads=tc.get("engram_n_heads", 0),
            engram_head_dim=tc.get("engram_head_dim", 0), engram_pad_id=tc.get("engram_pad_token_id", 2),
            engram_compressed_vocab_size=tc.get("engram_compressed_vocab_size", 0),
            image_token_id=cfg.get("image_token_id", 129264),
            dspark_block_size=tc.get("dspark_block_size", 0),
            dspark_noise_token_id=tc.get("dspark_noise_token_id", 128799),
            dspark_target_layer_ids=tuple(tc.get("dspark_target_layer_ids", ())),
            dspark_markov_rank=tc.get("dspark_markov_rank", 256),
            dspark_n_routed_experts=tc.get("dspark_n_routed_experts", 0),
            dspark_n_activated_experts=tc.get("dspark_num_experts_per_tok", 0),
            dtype="fp8" if q is not None else "bf16",
            expert_dtype=(q.get("expert_dtype", "fp4") if q is not None else None),
        )
        from .vision.config import VisionArgs
        args.vision = VisionArgs.from_hf(cfg.get("vision_config"), args.image_token_id)
        for k, v in overrides.items():
            setattr(args, k, v)
        args.validate()
        return args

    def validate(self) -> None:
        n = self.n_layers
        if self.score_func != "sqrtsoftplus":
            raise ConfigError(f"config.json field 'text_config.scoring_func' is {self.score_func!r}: "
                              "V4.1 uses 'sqrtsoftplus'")
        for L in self.kv_source_layers + self.index_source_layers:
            if not (0 <= L < n) or self.compress_ratios[L] <= 0:
                raise ConfigError(f"config.json field 'text_config.kv_source_layer_ids/index_source_layer_ids' "
                                  f"names layer {L}, which is not a compressed backbone layer")
        for L in range(n):
            if self.compress_ratios[L] > 0 and (self.kv_source_of(L) < 0 or self.index_source_of(L) < 0):
                raise ConfigError(f"config.json field 'text_config.compress_ratios': layer {L} is compressed "
                                  "but no KV / index source precedes it")
        for L in self.engram_layer_ids:
            if not 0 <= L < n:
                raise ConfigError(f"config.json field 'text_config.engram_layer_ids' names layer {L}")
        if len(self.engram_num_embeddings) != len(self.engram_layer_ids):
            raise ConfigError("config.json field 'text_config.engram_num_embeddings' needs one entry per Engram layer")
        if self.dspark_block_size and any(not 0 <= t < n for t in self.dspark_target_layer_ids):
            raise ConfigError("config.json field 'text_config.dspark_target_layer_ids' names a layer out of range")
        if self.head_dim % 32 or self.dim % 32:
            raise ConfigError("config.json fields 'hidden_size' and 'head_dim' must be multiples of 32")
