"""A request's state inside the engine: token ids, progress, and a small explicit state machine.

There is no prefill or decode phase: `num_computed_tokens` (tokens whose KV is in the caches)
catches up with `num_tokens` (prompt + generated so far), plus any draft tokens under
verification. A prompt chunk, a one-token decode and a 1+k verification are the same thing.

    WAITING --schedule--> RUNNING --stop/length--> FINISHED_STOPPED / FINISHED_LENGTH
       ^                     |
       +----PREEMPTED <------+ (out of cache blocks: caches freed, recomputed later)
    any non-finished state --abort--> FINISHED_ABORTED;  --engine fault--> FINISHED_ERROR
"""

from __future__ import annotations

import enum
import time

from deepinfer.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()


FINISHED = frozenset({
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
    RequestStatus.FINISHED_ERROR,
})

# finish state -> the finish_reason callers see (the recipe's / OpenAI's names)
FINISH_REASONS: dict[RequestStatus, str] = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """One generation request. Owned by the scheduler; the runner only sees its ids and counts."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None = None,
        forced_token_ids: list[int] | None = None,
        return_logits: bool = False,
        arrival_time: float | None = None,
        image_prompt=None,
        cache_salt: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        # deepinfer.model.vision.ImagePrompt: prompt_token_ids are its token_ids (spans expanded)
        self.image_prompt = image_prompt
        self.image_spans: list[tuple[int, int]] = image_prompt.spans if image_prompt is not None else []
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        # teacher forcing: output token k is forced_token_ids[k] whatever was sampled (scoring, tests)
        self.forced_token_ids = list(forced_token_ids) if forced_token_ids is not None else None
        self.return_logits = return_logits  # keep the fp32 logits of every sampled position
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.cache_salt = cache_salt        # prefix caching: only requests with the same salt share blocks
        self.block_hashes: list[bytes] = []  # chain hashes of the full blocks of all_token_ids (prefix caching)
        self.num_cached_tokens: int | None = None   # prompt tokens served from the prefix cache at admission

        self.status = RequestStatus.WAITING
        self.all_token_ids: list[int] = list(self.prompt_token_ids)  # prompt + generated
        self.num_computed_tokens = 0        # positions in the caches, counting the step in flight
        self.num_output_placeholders = 0    # tokens sampled by a step in flight, not yet known here
        self.spec_token_ids: list[int] = []  # draft tokens to verify at the next step
        self.num_preemptions = 0
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        # kv_role="decode" with kv_transfer_window=False: the window is rebuilt by bounded replay
        # (outputs.ReplayParams), taken by the scheduler at admission (disagg/connector.py)
        self.handover_replay = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids):]

    @property
    def images_ready(self) -> bool:
        """False while this request's images are still being encoded (it waits, the others run)."""
        return self.image_prompt is None or self.image_prompt.ready

    def clip_to_spans(self, start: int, num_new: int) -> int:
        """num_new, lowered so that the chunk [start, start + num_new) does not end inside an image
        span (a span is prefilled in one chunk: the reference asserts it, and its aligner rows are
        written as one block); 0 when the next span alone does not fit.

            tokens: | text | START IMAGE .. NEW_LINE .. END | text |
            chunk:  [start ........ end)     -> end moved back to START
        """
        end = start + num_new
        for s, e in self.image_spans:
            if start <= s < end < e:
                return s - start
        return num_new

    @property
    def is_finished(self) -> bool:
        return self.status in FINISHED

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens})")


class InvalidRequestError(ValueError):
    """Bad input from one caller (empty prompt, prompt too long, bad sampling params). Raised to
    that caller only; the engine keeps serving the others."""


class UnknownRequestError(KeyError):
    """abort() of a request id the engine does not hold (never added, or already finished)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown request id"


class EngineDeadError(RuntimeError):
    """The engine cannot run steps any more (a rank worker died or failed mid-step): every request
    in it has failed, and new ones are refused with this message."""
