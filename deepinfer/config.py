"""EngineArgs: the runtime knobs of the engine (separate from ModelArgs, which the checkpoint fixes)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields


@dataclass
class EngineArgs:
    checkpoint: str = ""                    # release-format checkpoint folder
    device: str = "auto"                    # "auto" = cuda when available, else cpu
    dtype: str = "bfloat16"                 # activation / cache dtype
    max_num_seqs: int = 64                  # running requests per step (also the number of window-ring slots)
    max_num_batched_tokens: int = 2048      # token budget per step (prefill chunks + decodes + drafts)
    max_model_len: int | None = None        # prompt + output limit; None = the model's max_seq_len
    block_tokens: int = 64                  # token positions per paged cache block
    num_cache_blocks: int | None = None     # paged blocks; None = from cache_memory_fraction (CUDA) or a default (CPU)
    cache_memory_fraction: float = 0.85     # of free device memory, when num_cache_blocks is None on CUDA
    async_scheduling: bool | None = None    # None = on for CUDA, off for CPU
    seed: int = 0
    batch_invariant: bool = False           # a request's logits do not depend on the batch (deepinfer/sample/BATCH_INVARIANCE.md)
    model_overrides: dict = field(default_factory=dict)  # ModelArgs runtime switches, e.g. {"emulate_index_k_alias": True}
    # speculative decoding (deepinfer/spec/): "dspark" drafts with the checkpoint's DSpark blocks; async
    # scheduling is then off (verification needs the accepted count before the next step)
    speculative: str | None = None          # None (off) or "dspark"
    num_speculative_tokens: int = 5         # drafts proposed per request and step (at most the DSpark block, 5)
    spec_confidence_threshold: float = 0.5  # verify drafts 1..j while prod_{i<=j} sigmoid(c_i) >= this (0 = all)
    # CUDA graphs for pure decode steps (deepinfer/worker/graph_step.py): batch sizes captured at start;
    # None = (1, 2, 4, .., 128) on CUDA and none on CPU (sizes given on a CPU run the padded step
    # eagerly: a test mode). Off with enforce_eager, batch_invariant, speculative decoding and the
    # index-key alias emulation.
    cuda_graph_sizes: tuple[int, ...] | None = None
    enforce_eager: bool = False             # never use CUDA graphs (vLLM's flag)
    # a decode step takes a graph only while every sequence is shorter than this (vLLM's knob): the
    # static step reads E = max_seq_len_to_capture // ratio compressed entries per sequence
    max_seq_len_to_capture: int = 8192
    # weights: "safetensors" (the release shards) or "dummy" (random weights of the checkpoint folder's
    # config.json made on each rank's device, vLLM's flag: whole-model benchmarks with no weights on disk)
    load_format: str = "safetensors"
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
    # (exact; CUDA-graph safe); None = "sharded" when data_parallel_size > 1 (deepinfer-plan: the
    # release tables do not fit one GPU)
    engram_placement: str | None = None
    distributed_backend: str | None = None  # None = "nccl" on CUDA, "gloo" on CPU
    worker_threads: int | None = None       # torch threads per CPU rank; None = cores / ranks
    # prefill/decode disaggregation (deepinfer/disagg/): "prefill" runs prompts, samples the first
    # token and holds the request's caches for a decode instance, which pulls them (NIXL READ) and
    # continues; "both" (default) does everything in one instance
    kv_role: str = "both"                   # "both" | "prefill" | "decode"
    kv_transfer_host: str = "127.0.0.1"     # address this instance's NIXL agent is reached at
    kv_transfer_port: int = 0               # NIXL metadata listener port; 0 = a free one
    kv_transfer_timeout_s: float = 30.0     # decode: a pull not done by then fails; prefill: held caches freed

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {self.block_tokens}")
        if self.num_cache_blocks is not None and self.num_cache_blocks < 1:
            raise ValueError(f"num_cache_blocks must be >= 1, got {self.num_cache_blocks}")
        if self.speculative not in (None, "dspark"):
            raise ValueError(f"speculative must be None or 'dspark', got {self.speculative!r}")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        if self.max_seq_len_to_capture < 1:
            raise ValueError(f"max_seq_len_to_capture must be >= 1, got {self.max_seq_len_to_capture}")
        if self.load_format not in ("safetensors", "dummy"):
            raise ValueError(f"load_format must be 'safetensors' or 'dummy', got {self.load_format!r}")
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {self.data_parallel_size}")
        if self.ep_backend not in ("allgather", "alltoall"):
            raise ValueError(f"ep_backend must be 'allgather' or 'alltoall', got {self.ep_backend!r}")
        if self.engram_placement not in (None, "device", "sharded"):
            raise ValueError(f"engram_placement must be 'device' or 'sharded', got {self.engram_placement!r}")
        if self.num_redundant_experts < 0:
            raise ValueError(f"num_redundant_experts must be >= 0, got {self.num_redundant_experts}")
        if self.eplb_window_size < 1 or self.eplb_step_interval < 1:
            raise ValueError(f"eplb_window_size and eplb_step_interval must be >= 1, got "
                             f"{self.eplb_window_size} and {self.eplb_step_interval}")
        if self.kv_role not in ("both", "prefill", "decode"):
            raise ValueError(f"kv_role must be 'both', 'prefill' or 'decode', got {self.kv_role!r}")
        if self.kv_role != "both" and self.data_parallel_size > 1:
            raise ValueError("kv_role 'prefill'/'decode' runs one rank per instance (data_parallel_size=1)")
        if self.kv_transfer_timeout_s <= 0:
            raise ValueError(f"kv_transfer_timeout_s must be > 0, got {self.kv_transfer_timeout_s}")
        if not 0 < self.cache_memory_fraction <= 1:
            raise ValueError(f"cache_memory_fraction must be in (0, 1], got {self.cache_memory_fraction}")

    @classmethod
    def from_kwargs(cls, checkpoint: str, **kwargs) -> "EngineArgs":
        names = {f.name for f in fields(cls)}
        unknown = set(kwargs) - names
        if unknown:
            raise TypeError(f"unknown engine args: {sorted(unknown)}")
        return cls(checkpoint=checkpoint, **kwargs)

    def resolved_engram_placement(self) -> str:
        return self.engram_placement or ("sharded" if self.data_parallel_size > 1 else "device")

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch
        return "cuda" if torch.cuda.is_available() else "cpu"
