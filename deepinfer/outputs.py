"""The contracts between the engine's stages: plain dataclasses, one comment per field.

    Engine.step():
        sched_out  = scheduler.schedule()                             # SchedulerOutput
        runner_out = model_runner.execute(sched_out)                  # ModelRunnerOutput
        return scheduler.update_from_output(sched_out, runner_out)    # list[RequestOutput]

The scheduler never sees tensors and the runner never decides policy: everything the runner must
know about a step (which requests, how many tokens, which blocks, which drafts to verify, which
layers to replay) is a value here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from deepinfer.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has not seen (first scheduled, or resumed after a preemption)."""
    req_id: str
    token_ids: list[int]                 # prompt + generated so far (a resumed request recomputes them)
    num_prompt_tokens: int
    num_computed_tokens: int             # 0 unless a prefix came from a cache
    sampling_params: SamplingParams
    block_ids: list[int]                 # paged blocks (block_tokens positions each), in position order
    ring_slot: int                       # the window-ring slot this request owns while running
    forced_token_ids: list[int] | None = None   # teacher forcing: output k := forced_token_ids[k]
    return_logits: bool = False          # return the fp32 logits of every sampled position
    image_prompt: Any | None = None      # deepinfer.model.vision.ImagePrompt: token types and images of the prompt
    replay: ReplayParams | None = None   # prefix hit rebuilt by bounded replay (num_computed_tokens = its start)
    restore: SnapshotCopy | None = None  # prefix hit on a window snapshot: copied in before the step


@dataclass
class CachedRequestData:
    """A request the runner already holds: what changed since its last step."""
    req_id: str
    num_computed_tokens: int             # authoritative (lowered after a rollback of rejected drafts)
    num_blocks: int                      # block-table length before appending new_block_ids (truncates after rollback)
    new_block_ids: list[int]             # blocks appended this step


@dataclass
class ReplayParams:
    """SWA bounded replay (MODEL.md section 9) of a prefix-cache hit that ends at `hit` (a block
    boundary) with no window snapshot there. The request starts at replay_start s = hit - min(R, hit)
    (R = swa_replay_tokens) and runs like any other: positions [s, hit) rebuild the window rings and
    compressor carry (attention still reads the cached compressed KV), then the uncached suffix.

        positions:  0 ........ s ......... hit | hit ......... num_tokens
                    compressed KV cached (blocks shared, never rewritten) | written as usual
                               <-- replay -->  window keys < s do not exist for it

    Two rules hold for the request's rows until they no longer matter: a query at i sees window
    keys in [max(s, i - W + 1), i] only, and no compressed entry below `hit` is written.
    """
    replay_start: int
    hit: int


@dataclass
class SnapshotCopy:
    """A window snapshot moved between a ring slot (+ its partial tail block) and a snapshot slot."""
    snapshot_slot: int
    ring_slot: int
    tail_block: int                      # -1 = the snapshot ends on a block boundary


@dataclass
class BlockCopy:
    """A cached block moved between the device pool and the host tier (cache/host_tier.py)."""
    kind: str                            # "offload" (device block -> host slot) | "onload" (host slot -> block)
                                         # | disk tier: "spill" (host slot -> file) | "disk_onload"
                                         #   (file -> block) | "disk_drop" (delete the file)
    block: int
    host_slot: int
    key: str = ""                        # disk tier (cache/disk_tier.py): the block file's name


@dataclass
class SchedulerOutput:
    new_reqs: list[NewRequestData]                  # first time scheduled (or resumed)
    cached_reqs: list[CachedRequestData]            # scheduled before; diffs only
    num_scheduled_tokens: dict[str, int]            # req_id -> tokens to run now (chunk, 1, or 1+k)
    total_num_scheduled_tokens: int                 # sum of the above (<= the step budget)
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)   # req_id -> draft ids to verify (last k of its scheduled tokens)
    snapshot_saves: list[SnapshotCopy] = field(default_factory=list)  # ended requests' window state, copied
                                                                      # out before anything of this step runs
    block_copies: list[BlockCopy] = field(default_factory=list)       # host tier, in decision order, after the saves
    finished_req_ids: set[str] = field(default_factory=set)          # runner frees their per-request state
    preempted_req_ids: set[str] = field(default_factory=set)         # runner frees them too (they come back as new_reqs)
    # a verify step scheduled with the previous one unresolved (spec/overlap.py): spec_tokens hold -1
    # placeholders, the drafts are the previous step's device-side proposal
    overlapped: bool = False
    # an overlapped step's verification policy, device half (spec/device_verify.py); None: verify all
    overlap_verify: Any = None
    # speculation: the step drafts after it (False: speculation paused, spec/pause.py; the accepted rows
    # still go into the DSpark rings)
    draft_after: bool = True

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]                              # batch order
    sampled_token_ids: list[list[int]]              # per request: accepted drafts + 1 new token; [] for a partial prefill
    logprobs: list[list[Any] | None] | None = None  # per request, one entry per sampled token (sampler's format)
    logits: dict[str, Any] | None = None            # req_id -> fp32 [n, V] logits of the sampled positions (return_logits)
    draft_token_ids: list[list[int]] | None = None  # next step's proposals (DSpark), batch order; [] = none
    draft_confidences: list[list[float]] | None = None  # per draft, the confidence logit (pre-sigmoid); the
                                                        # scheduler's policy picks the prefix to verify
    num_verified: list[int] | None = None           # an overlapped step: drafts each request verified (picked
                                                    # on the device, <= its spec_tokens); None: all of them


@dataclass
class RequestOutput:
    """What a caller receives after each engine step: the request's delta.

    new_token_ids are the tokens generated since the previous RequestOutput of this request;
    finish_reason is None until the last one ("stop", "length", "abort" or "error").
    """
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int                          # generated so far, this delta included
    new_logprobs: list[Any] | None = None           # one entry per new token when SamplingParams.logprobs is set
    logits: Any | None = None                       # fp32 [len(new_token_ids), V] when return_logits was asked
    error: str | None = None                        # why, when finish_reason == "error"
    num_cached_tokens: int = 0                      # prompt tokens whose KV came from the prefix cache
    # kv_role="prefill": the final output's hand-over to a decode instance (deepinfer/disagg/params.py)
    kv_transfer_params: dict | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class CompletionOutput:
    """One finished request, as LLM.generate returns it (vLLM-like)."""
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[Any] | None = None
    logits: Any | None = None                       # fp32 [num_output_tokens, V] when return_logits was asked
    num_cached_tokens: int = 0                      # prompt tokens whose KV came from the prefix cache

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids)
