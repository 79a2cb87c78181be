"""EngineArgs: the runtime knobs of the engine (separate from ModelArgs, which the checkpoint fixes)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields


# a prefill-only step's default budget on CUDA: four 2,048-token chunks' worth, the size the prefill
# benchmarks measure (the MoE takes its bf16 grouped path from ~2,700 prompt tokens)
PREFILL_ONLY_TOKENS_CUDA = 8192


@dataclass
class EngineArgs:
    checkpoint: str = ""                    # release-format checkpoint folder
    device: str = "auto"                    # "auto" = cuda when available, else cpu
    dtype: str = "bfloat16"                 # activation / cache dtype
    max_num_seqs: int = 64                  # running requests per step (also the number of window-ring slots)
    max_num_batched_tokens: int = 2048      # token budget per step (prefill chunks + decodes + drafts)
    # the budget of a step in which no request decodes (every row a prompt chunk): no decode waits on it and
    # longer chunks run faster (H200, the release's 40 layers, 2026-12-03: 8,192 prompt tokens in one step
    # 596-624 ms, in 2,048-token chunks 698-1,234 ms). None: PREFILL_ONLY_TOKENS_CUDA on CUDA (at least
    # max_num_batched_tokens), max_num_batched_tokens elsewhere. Such a step's activations (and, past ~2.7k
    # tokens, the MoE's bf16 stack scratch, ~2.3 GB at full width) live in the memory the caches leave
    # (1 - cache_memory_fraction); where that is tight, set it to max_num_batched_tokens
    max_prefill_only_tokens: int | None = None
    max_model_len: int | None = None        # prompt + output limit; None = the model's max_seq_len
    block_tokens: int = 64                  # token positions per paged cache block
    num_cache_blocks: int | None = None     # paged blocks; None = from cache_memory_fraction (CUDA) or a default (CPU)
    cache_memory_fraction: float = 0.85     # of free device memory, when num_cache_blocks is None on CUDA
    async_scheduling: bool | None = None    # None = on for CUDA, off for CPU
    seed: int = 0
    batch_invariant: bool = False           # a request's logits do not depend on the batch (deepinfer/sample/BATCH_INVARIANCE.md)
    model_overrides: dict = field(default_factory=dict)  # ModelArgs runtime switches, e.g. {"emulate_index_k_alias": True}
    # speculative decoding (deepinfer/spec/): "dspark" drafts with the checkpoint's DSpark blocks; with
    # async scheduling (CUDA's default) verify steps overlap where they can (spec_async_overlap)
    speculative: str | None = None          # None (off) or "dspark"
    num_speculative_tokens: int = 5         # drafts proposed per request and step (at most the DSpark block, 5)
    # which drafts to verify: "scheduler" (batch budget maximizing expected accepted tokens per profiled
    # step second, spec/budget.py; profiled at start), "threshold" (static prefix threshold), "all"
    spec_policy: str = "scheduler"
    spec_confidence_threshold: float = 0.5  # "threshold": verify drafts 1..j while prod_{i<=j} sigmoid(c_i) >= this
    spec_early_stop: bool = False           # "scheduler": stop at the first budget that does not pay (the paper's variant)
    spec_budget_confidences: str = "older"  # "scheduler": budget from the previous proposal's confidences, or "newest"
    # "scheduler": verify at least the drafts that keep the expected accepted tokens >= this fraction of
    # verify-all's (a per-user latency floor under the throughput argmax, which at 40 layers cuts to ~0.92);
    # None = the argmax alone (DeepInfer)
    spec_acceptance_floor: float | None = None
    # "scheduler" with older confidences: calibrate them online against the newest (spec/older_calibration.py);
    # False = take them as they are (DeepInfer)
    spec_calibrate_older: bool = True
    # "scheduler": pause drafting where plain decode steps are faster (spec/pause.py; the profile then also
    # times plain steps); a paused batch drafts again every spec_pause_probe_every-th step to re-measure
    spec_pause: bool = False
    spec_pause_probe_every: int = 16
    # "scheduler": a folder that keeps the step-time profile across starts (spec/step_time_cache.py): read
    # back when the device, the code, the checkpoint's config and the engine arguments match; None = profile
    # at every start
    spec_step_time_cache: str | None = None
    # "scheduler": correct the profiled step times from the verify steps the engine runs (growing contexts,
    # other load; spec/step_time_online.py); off by default until measured on the H200
    spec_step_time_online: bool = False
    # verify steps through CUDA graphs keyed by the rows they verify (packed, varlen: worker/graph_step.py
    # VerifyKeys), so a request verifying fewer drafts shortens the step; False = every request padded
    # to the longest one's length
    spec_packed_verify: bool = True
    # acceptance (deepinfer/sample/rejection.py): "identical" = greedy drafts accepted where they equal the
    # seeded sample (tokens identical to no speculation); "sampled" = requests at temperature > 0 sample
    # their drafts and accept with min(1, p/q), residual resample (same distribution, more accepted)
    spec_acceptance: str = "identical"
    # benchmark mode (spec/replay.py): replay acceptance outcomes and calibrated confidences drawn with
    # this mean accepted length (verify-all, tokens per step, e.g. 3.5 of 5 drafts); None = real drafts
    spec_replay_accepted_length: float | None = None
    # ... and this Beta concentration kappa of the confidences (small: sharp, near 0 or 1; large: alike)
    spec_replay_concentration: float = 2.0
    # ... persisting over regimes of this many positions (0: drawn independently per proposal)
    spec_replay_regime_tokens: int = 0
    # with async scheduling: verify steps overlap (spec/overlap.py): the next one is scheduled with
    # the worst-case reservation and launched from the device-side resolution before this one's
    # accepted counts reach the host (greedy or seeded temperature > 0 requests, with logprobs or
    # penalties too, without a grammar; anything else is resolved first); False = every
    # step that samples is resolved before the next schedule
    spec_async_overlap: bool = True
    # CUDA graphs for decode steps and DSpark verify steps (deepinfer/worker/graph_step.py): batch sizes
    # captured at start (x verified lengths 1 .. num_speculative_tokens + 1 with speculative="dspark");
    # None = (1, 2, 4, .., 128) on CUDA and none on CPU (sizes given on a CPU run the padded step
    # eagerly: a test mode). Off with enforce_eager, batch_invariant on CUDA and the index-key alias
    # emulation. Rank workers (data_parallel_size > 1) capture decode and verify steps in lockstep (every
    # rank the same key a step: parallel/lockstep.py), not with the all-to-all dispatcher, and on CUDA only
    # sizes whose gathered picks fit the masked MoE form (EP 8, top-6: up to 64).
    cuda_graph_sizes: tuple[int, ...] | None = None
    enforce_eager: bool = False             # never use CUDA graphs (vLLM's flag)
    # a decode step takes a graph only while every sequence is shorter than this (vLLM's knob): the
    # static step reads E = max_seq_len_to_capture // ratio compressed entries per sequence
    max_seq_len_to_capture: int = 8192
    # weights: "safetensors" (the release shards) or "dummy" (random weights of the checkpoint folder's
    # config.json made on each rank's device, vLLM's flag: whole-model benchmarks with no weights on disk)
    load_format: str = "safetensors"
    # load_format="dummy" only: "model" (the random gates' own picks: a step's tokens land on a few experts)
    # or "balanced" (each expert once before any twice, the load a trained, load-balanced router approaches:
    # model/balanced_routing.py; a token's experts then follow its row in the step, so outputs depend on
    # the batch): what throughput benchmarks on dummy weights should read
    dummy_routing: str = "model"
    # "fp8" (the release format on the device: FP8 kernels) or "bf16": the dense FP8 linears (not the
    # routed experts) dequantized exactly at load and run by act_quant + cuBLAS in every step, decode
    # graphs included; one more byte per dense weight element (~6 GB per GPU for the release's 40 layers).
    # "bf16+fp8": bf16 as above, plus the release's FP8 bytes kept beside every one of them for decode-sized
    # calls on the CUDA FP8 x FP8 decode GEMM (kernels/cuda_fp8_decode.py) where its measured table has it
    # faster; one more byte per element again. "auto": bf16 on CUDA where the extra byte fits 8% of the
    # device's memory (worker/loading.py hold_dense_bf16; H200, 2026-12-03: batch-64 verify steps 1.37x,
    # batch-128 decode 1.08x, the per-call dequant of prefill gone), fp8 elsewhere (a CPU computes the same
    # values either way), and within the same 8% the FP8 copies of the linears the GPU's decode table says pay
    # at <= 64 tokens, most time saved per byte first (dense_fp8_copies: on an H200 the release's wq_b, wo_b,
    # wqkv_a and shared w13; every expert read, H100, 2026-12-06, the batch-64 step 6.68-6.84 ms on bf16 alone,
    # 6.51-6.64 with the copies)
    dense_weights: str = "auto"
    # the routed experts on CUDA: "fp8" (e4m3 stacks, twice the release's bytes: the W8A16 / FP8 x FP8
    # kernels) or "fp4" (the release's MXFP4 bytes, half the experts' memory: the W4A16 kernels at decode,
    # a per-step dequant for the prefill's bf16 grouped GEMM; H200, 2026-12-04: the same decode step and
    # whole-prompt prefill times, 1.05-1.10x the FP8 stacks' masked GEMMs alone, 0.85x on 2,048-token
    # chunked prefill; the release on 8 H200s leaves 46.6 GiB per GPU for the KV cache instead of 8.7).
    # "auto": fp4 on CUDA where the FP8 stacks would take over a quarter of the device (the release at
    # EP8), unless batch_invariant or DEEPINFER_GEMM=deepgemm (worker/loading.py resolved_expert_format)
    expert_format: str = "auto"
    # multi-GPU (deepinfer/parallel/): attention data parallel over data_parallel_size ranks (one per
    # GPU; CPU processes with gloo on a CPU run), the backbone's routed experts split over them
    # (expert_parallel; EP = DP at TP 1). The driver process schedules; the ranks run the model.
    data_parallel_size: int = 1
    expert_parallel: bool = True            # False: every rank holds every expert (replicas, no MoE collectives)
    ep_backend: str = "allgather"           # dispatch/combine: "allgather" (graph-safe) | "alltoall"
    num_redundant_experts: int = 0          # extra physical expert slots per layer (EPLB replicas)
    enable_eplb: bool = False               # rebalance the expert placement while serving
    eplb_window_size: int = 100             # steps of expert load the policy sees (DeepInfer's default)
    eplb_step_interval: int = 3000          # steps between rebalances (the first after a quarter of it)
    eplb_placement_file: str | None = None  # static placement (ExpertPlacement.save) loaded at start
    # Engram tables (196B params at full size): "device" = a whole copy on every rank, "sharded" = rows
    # split over the ranks, looked up by an all-gather of the hash ids and a reduce-scatter of the rows
    # (exact; CUDA-graph safe); "host" = one copy per node in host memory, read by the GPU from there inside the
    # step (model/host_tables.py); None = "sharded" when data_parallel_size > 1 (deepinfer-plan: the release
    # tables do not fit one GPU)
    engram_placement: str | None = None
    # balanced context parallelism (deepinfer/parallel/cp.py): a prompt of at least cp_min_prompt_tokens
    # scheduled whole from position 0 is prefilled by every rank at once, each rank taking two mirrored
    # chunks (equal causal work); its caches stay on its own DP rank, which decodes it. 1 = off; else
    # it must equal data_parallel_size (CP runs over the DP ranks); max_num_batched_tokens must hold such
    # a prompt (a prompt chunked over steps is prefilled the ordinary way)
    context_parallel_size: int = 1
    cp_min_prompt_tokens: int = 8192
    distributed_backend: str | None = None  # None = "nccl" on CUDA, "gloo" on CPU
    # prefix caching (deepinfer/cache, sched/prefix_admission.py; vLLM's flag): full blocks of compressed KV
    # and index keys shared by content hash; a hit rebuilds the window by replaying its last
    # swa_replay_tokens tokens (>= the model's window), or restores an ended request's window snapshot
    # (exact) from a pool of window_snapshot_bytes (None = 2 x max_num_seqs snapshots; 0 = none), LRU,
    # entries older than window_snapshot_ttl_s never served. One rank only (data_parallel_size 1).
    enable_prefix_caching: bool = False
    swa_replay_tokens: int = 128
    window_snapshot_bytes: int | None = None
    window_snapshot_ttl_s: float = 300.0
    # the prefix cache's host-memory tier (cache/host_tier.py): cached blocks evicted from the device go
    # to (pinned) host memory of this size and come back on a hit; 0 = off
    host_cache_bytes: int = 0
    # YOCO prefill truncation (deepinfer/model/yoco.py, DeepInfer's compact mode): 0 = off (exact);
    # N > 0 = decoder layers (from the first ratio-1 layer) run only the last N rows of a prompt, their
    # compressed KV still comes from every row. Approximate by design; DeepInfer runs 140 for V4.1.
    # N must be >= the window + the largest rollback (num_speculative_tokens + 1 with drafts).
    yoco_prefill_keep_tokens: int = 0
    # the prefix cache's disk tier (cache/disk_tier.py), under the host tier: blocks the host tier
    # evicts are written to files in a fresh folder under disk_cache_dir (removed at exit), at most
    # disk_cache_bytes of them, LRU, and read back on a hit; 0 = off
    disk_cache_dir: str | None = None
    disk_cache_bytes: int = 0
    worker_threads: int | None = None       # torch threads per CPU rank; None = cores / ranks
    # prefill/decode disaggregation (deepinfer/disagg/): "prefill" runs prompts, samples the first
    # token and holds the request's caches for a decode instance, which pulls them (NIXL READ) and
    # continues; "both" (default) does everything in one instance
    kv_role: str = "both"                   # "both" | "prefill" | "decode"
    kv_transfer_host: str = "127.0.0.1"     # address this instance's NIXL agent is reached at
    kv_transfer_port: int = 0               # NIXL metadata listener port; 0 = a free one (rank workers: port + rank)
    kv_transfer_timeout_s: float = 30.0     # decode: a pull not done by then fails; prefill: held caches freed
    # decode: True pulls the window ring rows of the last 128 positions of every layer (DSpark rings
    # included) and the compressor carry with the blocks (exact); False pulls only the compressed-KV
    # and index-key blocks of the full blocks and rebuilds the window by bounded replay of the last
    # swa_replay_tokens positions (the prefix cache's replay: fewer bytes, approximate past 128 tokens)
    kv_transfer_window: bool = True
    # the vision tower's encodes run on this share of the GPU's SMs (a CUDA green context:
    # worker/sm_partition.py), so images arriving back to back cannot crowd the decode steps off the GPU.
    # H100, 2026-12-06 (perf/vision_encode.py --sm-shares, batch-16 decode beside photos encoded back to
    # back): every SM x4.13 step time at 39.6 images/s; 0.5 x1.80 at 18.2; 0.25 x1.38 at 7.9; 0.125 x1.30 at
    # 4.2 (the decode time lost per image about the same at 1 and 0.5: 19 / 24 ms). None or 1: every SM (also
    # where the driver has no green contexts, said once in the log); rank workers encode inline
    vision_sm_share: float | None = 0.5

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_prefill_only_tokens is not None and self.max_prefill_only_tokens < self.max_num_batched_tokens:
            raise ValueError(f"max_prefill_only_tokens={self.max_prefill_only_tokens} is below max_num_batched_tokens="
                             f"{self.max_num_batched_tokens}: a step without decodes may only take more tokens")
        if self.block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {self.block_tokens}")
        if self.num_cache_blocks is not None and self.num_cache_blocks < 1:
            raise ValueError(f"num_cache_blocks must be >= 1, got {self.num_cache_blocks}")
        if self.speculative not in (None, "dspark"):
            raise ValueError(f"speculative must be None or 'dspark', got {self.speculative!r}")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        self._check_spec_args()
        if self.max_seq_len_to_capture < 1:
            raise ValueError(f"max_seq_len_to_capture must be >= 1, got {self.max_seq_len_to_capture}")
        if self.expert_format not in ("auto", "fp8", "fp4"):
            raise ValueError(f"expert_format must be 'auto', 'fp8' or 'fp4', got {self.expert_format!r}")
        if self.dense_weights not in ("auto", "fp8", "bf16", "bf16+fp8"):
            raise ValueError(f"dense_weights must be 'auto', 'fp8', 'bf16' or 'bf16+fp8', got {self.dense_weights!r}")
        if self.load_format not in ("safetensors", "dummy"):
            raise ValueError(f"load_format must be 'safetensors' or 'dummy', got {self.load_format!r}")
        if self.dummy_routing not in ("model", "balanced"):
            raise ValueError(f"dummy_routing must be 'model' or 'balanced', got {self.dummy_routing!r}")
        if self.dummy_routing == "balanced" and self.load_format != "dummy":
            raise ValueError("dummy_routing='balanced' replaces the gates' picks: only with load_format='dummy'")
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {self.data_parallel_size}")
        if self.ep_backend not in ("allgather", "alltoall"):
            raise ValueError(f"ep_backend must be 'allgather' or 'alltoall', got {self.ep_backend!r}")
        if self.engram_placement not in (None, "device", "sharded", "host"):
            raise ValueError(f"engram_placement must be 'device', 'sharded' or 'host', got {self.engram_placement!r}")
        if self.num_redundant_experts < 0:
            raise ValueError(f"num_redundant_experts must be >= 0, got {self.num_redundant_experts}")
        if self.eplb_window_size < 1 or self.eplb_step_interval < 1:
            raise ValueError(f"eplb_window_size and eplb_step_interval must be >= 1, got "
                             f"{self.eplb_window_size} and {self.eplb_step_interval}")
        if self.context_parallel_size != 1 and self.context_parallel_size != self.data_parallel_size:
            raise ValueError(f"context_parallel_size must be 1 (off) or equal data_parallel_size "
                             f"({self.data_parallel_size}): balanced CP runs over the DP ranks; got "
                             f"{self.context_parallel_size}")
        if self.cp_min_prompt_tokens < 1:
            raise ValueError(f"cp_min_prompt_tokens must be >= 1, got {self.cp_min_prompt_tokens}")
        if self.context_parallel_size > 1 and self.cp_min_prompt_tokens > self.max_num_batched_tokens:
            raise ValueError(f"cp_min_prompt_tokens={self.cp_min_prompt_tokens} exceeds max_num_batched_tokens="
                             f"{self.max_num_batched_tokens}: balanced CP prefills a prompt scheduled whole in one "
                             "step, so it would never run; raise max_num_batched_tokens")
        if self.window_snapshot_bytes is not None and self.window_snapshot_bytes < 0:
            raise ValueError(f"window_snapshot_bytes must be >= 0, got {self.window_snapshot_bytes}")
        if self.yoco_prefill_keep_tokens < 0:
            raise ValueError(f"yoco_prefill_keep_tokens must be >= 0 (0 = off), got {self.yoco_prefill_keep_tokens}")
        if self.yoco_prefill_keep_tokens and self.context_parallel_size > 1:
            raise ValueError("yoco_prefill_keep_tokens does not combine with context_parallel_size > 1 yet (the "
                             "truncation would need the kept rows gathered across the CP ranks)")
        if self.disk_cache_bytes < 0:
            raise ValueError(f"disk_cache_bytes must be >= 0, got {self.disk_cache_bytes}")
        if self.host_cache_bytes < 0:
            raise ValueError(f"host_cache_bytes must be >= 0, got {self.host_cache_bytes}")
        if self.window_snapshot_ttl_s <= 0:
            raise ValueError(f"window_snapshot_ttl_s must be > 0, got {self.window_snapshot_ttl_s}")
        if self.kv_role not in ("both", "prefill", "decode"):
            raise ValueError(f"kv_role must be 'both', 'prefill' or 'decode', got {self.kv_role!r}")
        if self.kv_role == "decode" and self.context_parallel_size > 1:
            # balanced CP splits a prompt's prefill over the ranks; a decode instance's prompts arrive prefilled
            raise ValueError("kv_role 'decode' does not combine with context_parallel_size > 1 (its requests' caches "
                             "are pulled from the prefill instance, which is where balanced CP splits a prompt)")
        if self.kv_role == "decode" and self.enable_prefix_caching:
            # a decode instance's prompts arrive as pulled caches, never as a hit on its own cache
            raise ValueError("kv_role 'decode' does not combine with enable_prefix_caching (its requests' caches are "
                             "pulled from the prefill instance, whose prefix cache serves them)")
        if self.vision_sm_share is not None and not 0 < self.vision_sm_share <= 1:
            raise ValueError(f"vision_sm_share must be in (0, 1] or None, got {self.vision_sm_share!r}")
        if self.kv_transfer_timeout_s <= 0:
            raise ValueError(f"kv_transfer_timeout_s must be > 0, got {self.kv_transfer_timeout_s}")
        if not 0 < self.cache_memory_fraction <= 1:
            raise ValueError(f"cache_memory_fraction must be in (0, 1], got {self.cache_memory_fraction}")

    def _check_spec_args(self) -> None:
        if self.spec_policy not in ("scheduler", "threshold", "all"):
            raise ValueError(f"spec_policy must be 'scheduler', 'threshold' or 'all', got {self.spec_policy!r}")
        if not 0.0 <= self.spec_confidence_threshold <= 1.0:
            raise ValueError(f"spec_confidence_threshold must be in [0, 1], got {self.spec_confidence_threshold}")
        if self.spec_budget_confidences not in ("older", "newest"):
            raise ValueError(f"spec_budget_confidences must be 'older' or 'newest', got {self.spec_budget_confidences!r}")
        if self.spec_acceptance not in ("identical", "sampled"):
            raise ValueError(f"spec_acceptance must be 'identical' or 'sampled', got {self.spec_acceptance!r}")
        r = self.spec_replay_accepted_length
        if r is not None and not 1.0 <= r < 1 + self.num_speculative_tokens:
            raise ValueError(f"spec_replay_accepted_length must be in [1, {1 + self.num_speculative_tokens}), got {r}")
        if not self.spec_replay_concentration > 0:
            raise ValueError(f"spec_replay_concentration must be > 0, got {self.spec_replay_concentration}")
        f = self.spec_acceptance_floor
        if f is not None and not 0.0 < f <= 1.0:
            raise ValueError(f"spec_acceptance_floor must be in (0, 1] or None, got {f}")
        if f is not None and self.spec_policy != "scheduler":
            raise ValueError(f"spec_acceptance_floor needs spec_policy='scheduler' (the floor bounds its budget), "
                             f"got {self.spec_policy!r}")
        if self.spec_pause and self.spec_policy != "scheduler":
            raise ValueError(f"spec_pause needs spec_policy='scheduler' (its step-time model decides), "
                             f"got {self.spec_policy!r}")
        if self.spec_step_time_cache is not None and self.spec_policy != "scheduler":
            raise ValueError(f"spec_step_time_cache needs spec_policy='scheduler' (the only policy that profiles), "
                             f"got {self.spec_policy!r}")
        if self.spec_step_time_online and self.spec_policy != "scheduler":
            raise ValueError(f"spec_step_time_online needs spec_policy='scheduler' (the only policy with a step-time "
                             f"model), got {self.spec_policy!r}")
        if self.spec_pause_probe_every < 1:
            raise ValueError(f"spec_pause_probe_every must be >= 1, got {self.spec_pause_probe_every}")
        if self.spec_replay_regime_tokens < 0:
            raise ValueError(f"spec_replay_regime_tokens must be >= 0, got {self.spec_replay_regime_tokens}")

    @classmethod
    def from_kwargs(cls, checkpoint: str, **kwargs) -> "EngineArgs":
        names = {f.name for f in fields(cls)}
        unknown = set(kwargs) - names
        if unknown:
            raise TypeError(f"unknown engine args: {sorted(unknown)}")
        return cls(checkpoint=checkpoint, **kwargs)

    def resolved_engram_placement(self) -> str:
        return self.engram_placement or ("sharded" if self.data_parallel_size > 1 else "device")

    def prefill_only_tokens(self, device: str) -> int:
        """The token budget of a step in which no request decodes, on this device."""
        if self.max_prefill_only_tokens is not None:
            return self.max_prefill_only_tokens
        if device.startswith("cuda"):
            return max(self.max_num_batched_tokens, PREFILL_ONLY_TOKENS_CUDA)
        return self.max_num_batched_tokens

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch
        return "cuda" if torch.cuda.is_available() else "cpu"
