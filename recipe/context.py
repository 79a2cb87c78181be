"""What travels from the preprocess to the postprocess, through the engine's echo.

A decoupled ensemble forbids the postprocess from reading preprocess outputs directly
(TRITON.md section 0), so the engine echoes `RequestContext` once, on its first response, and the
postprocess rebuilds the request's StreamProcessor from it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

API_KINDS = ("chat.completions", "responses", "messages")
TEXT_API = "text"   # the TensorRT-LLM style inputs (`text_input`, ...)


@dataclass
class RequestContext:
    api: str                      # one of API_KINDS or TEXT_API
    response_id: str              # id of the API response (also the Messages thinking signature)
    model: str = ""               # model name as the client asked for it, echoed in responses
    body: str = ""                # the API request body (the postprocess re-converts it)
    stream: bool = False
    prompt_tokens: int = 0
    error_status: int = 0         # != 0: the request was rejected; error_body is the API's error JSON
    error_body: str = ""
    error_message: str = ""       # a rejection found after the preprocess (the engine's admission
                                  # checks): the postprocess writes error_body from it
    input_text: str = ""          # text API with exclude_input_in_output=false: echoed first
    stop_words: list[str] = field(default_factory=list)   # text API stop strings

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str | bytes) -> "RequestContext":
        return cls(**json.loads(text))


@dataclass
class PreparedRequest:
    """The preprocess result: what the engine needs plus the context it echoes."""

    request_key: str                    # engine request id; the stop input uses it
    prompt_token_ids: list[int]
    sampling: dict                      # keyword arguments of deepinfer.SamplingParams
    stream: bool
    context: RequestContext
    images: object | None = None        # recipe.images.RequestImages (one per placeholder), None = text
    kv_transfer_params: str = ""        # a prefill replica's hand-over (JSON), for the engine as given

    @property
    def rejected(self) -> bool:
        return self.context.error_status != 0
