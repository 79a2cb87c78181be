"""The tensor contract of the serving path: one table, the only place tensor names live.

    client --request/api | text_input...--> recipe_preprocess --_input_ids,_sampling,...--> deepinfer
           <--response,text_output,...---- recipe_postprocess <--_output_ids,_context_echo,...--

Each row is one input or output of one composing model, and the ensemble tensor it is wired to
(names without a leading underscore are the ensemble's own API inputs/outputs; `None` = not wired,
used only when the model is called directly). The ensemble's inputs and outputs, every config.pbtxt
(see config.py) and the model.py files are derived from it.

Rules it encodes (TRITON.md section 0): the postprocess reads only what the engine emits (the engine
echoes `context` and `request_key`), and every tensor is present on every response (the engine sends
an empty context after the first response) so no ensemble step waits on a missing input.
"""

from __future__ import annotations

from dataclasses import dataclass

PREPROCESS, ENGINE, POSTPROCESS, ENSEMBLE = "recipe_preprocess", "deepinfer", "recipe_postprocess", "deepseek_v41_flash"
COMPOSING = (PREPROCESS, ENGINE, POSTPROCESS)
IN, OUT = "input", "output"
BYTES, BOOL, INT32, UINT64, FP32 = "TYPE_STRING", "TYPE_BOOL", "TYPE_INT32", "TYPE_UINT64", "TYPE_FP32"
UINT8 = "TYPE_UINT8"
# config dtype -> numpy dtype name (model.py builds tensors with it)
NUMPY = {BYTES: "object", BOOL: "bool", INT32: "int32", UINT64: "uint64", FP32: "float32", UINT8: "uint8"}


@dataclass(frozen=True)
class Tensor:
    model: str
    io: str
    name: str
    dtype: str
    dims: tuple[int, ...]
    optional: bool
    wire: str | None      # ensemble tensor this is read from / written to


_ = None
TABLE: tuple[Tensor, ...] = tuple(Tensor(*row) for row in (
    # model        io   name                      dtype   dims   optional wire
    # API request (JSON body) + which API it is: chat.completions | responses | messages
    (PREPROCESS,  IN,  "request",                 BYTES,  (1,),  True,  "request"),
    (PREPROCESS,  IN,  "api",                     BYTES,  (1,),  True,  "api"),
    # TensorRT-LLM style inputs (genai-perf, Triton's OpenAI frontend); used when `request` is absent
    (PREPROCESS,  IN,  "text_input",              BYTES,  (1,),  True,  "text_input"),
    (PREPROCESS,  IN,  "max_tokens",              INT32,  (1,),  True,  "max_tokens"),
    (PREPROCESS,  IN,  "stream",                  BOOL,   (1,),  True,  "stream"),
    (PREPROCESS,  IN,  "temperature",             FP32,   (1,),  True,  "temperature"),
    (PREPROCESS,  IN,  "top_p",                   FP32,   (1,),  True,  "top_p"),
    (PREPROCESS,  IN,  "top_k",                   INT32,  (1,),  True,  "top_k"),
    (PREPROCESS,  IN,  "seed",                    UINT64, (1,),  True,  "seed"),
    (PREPROCESS,  IN,  "stop_words",              BYTES,  (-1,), True,  "stop_words"),
    (PREPROCESS,  IN,  "exclude_input_in_output", BOOL,   (1,),  True,  "exclude_input_in_output"),
    # the client's own request key (unique; default: a fresh uuid): a gateway knows the key to stop
    # the engine with before any response arrives (a disconnect during prefill, a non-streaming request)
    (PREPROCESS,  IN,  "request_key",             BYTES,  (1,),  True,  "request_key"),
    # prefill/decode disaggregation (deepinfer/disagg/): a prefill replica's hand-over (JSON of
    # KVTransferParams) given to a decode replica; "" / absent = an ordinary request
    (PREPROCESS,  IN,  "kv_transfer_params",      BYTES,  (1,),  True,  "kv_transfer_params"),
    (PREPROCESS,  OUT, "input_ids",               INT32,  (-1,), False, "_input_ids"),
    (PREPROCESS,  OUT, "sampling",                BYTES,  (1,),  False, "_sampling"),      # SamplingParams JSON
    (PREPROCESS,  OUT, "streaming",               BOOL,   (1,),  False, "_streaming"),
    (PREPROCESS,  OUT, "context",                 BYTES,  (1,),  False, "_context"),       # recipe RequestContext JSON
    (PREPROCESS,  OUT, "request_key",             BYTES,  (1,),  False, "_request_key"),
    # the prompt's images, one per placeholder id in input_ids, planned and padded from the original
    # bytes (deepinfer.model.vision): RGB bytes row-major [H, W, 3] concatenated, and [h0, w0, h1, ..]
    (PREPROCESS,  OUT, "image_pixels",            UINT8,  (-1,), False, "_image_pixels"),
    (PREPROCESS,  OUT, "image_sizes",             INT32,  (-1,), False, "_image_sizes"),
    (PREPROCESS,  OUT, "kv_transfer_params",      BYTES,  (1,),  False, "_kv_transfer_params"),   # passed through
    # the engine: a stop request carries only request_key + stop=true (TensorRT-LLM convention)
    (ENGINE,      IN,  "input_ids",               INT32,  (-1,), True,  "_input_ids"),
    (ENGINE,      IN,  "sampling",                BYTES,  (1,),  True,  "_sampling"),
    (ENGINE,      IN,  "streaming",               BOOL,   (1,),  True,  "_streaming"),
    (ENGINE,      IN,  "context",                 BYTES,  (1,),  True,  "_context"),
    (ENGINE,      IN,  "request_key",             BYTES,  (1,),  False, "_request_key"),
    (ENGINE,      IN,  "stop",                    BOOL,   (1,),  True,  _),
    (ENGINE,      IN,  "image_pixels",            UINT8,  (-1,), True,  "_image_pixels"),
    (ENGINE,      IN,  "image_sizes",             INT32,  (-1,), True,  "_image_sizes"),
    (ENGINE,      IN,  "kv_transfer_params",      BYTES,  (1,),  True,  "_kv_transfer_params"),
    (ENGINE,      OUT, "output_ids",              INT32,  (-1,), False, "_output_ids"),    # new ids of this step
    (ENGINE,      OUT, "logprobs",                BYTES,  (1,),  False, "_logprobs"),      # JSON [[lp, [[id, lp]..]]..] or ""
    (ENGINE,      OUT, "finish_reason",           BYTES,  (1,),  False, "_finish_reason"), # "" until the last response
    (ENGINE,      OUT, "num_input_tokens",        INT32,  (1,),  False, "_num_input_tokens"),
    (ENGINE,      OUT, "num_output_tokens",       INT32,  (1,),  False, "_num_output_tokens"),  # cumulative
    (ENGINE,      OUT, "num_cached_tokens",       INT32,  (1,),  False, "_num_cached_tokens"),  # prompt tokens from the prefix cache
    (ENGINE,      OUT, "context",                 BYTES,  (1,),  False, "_context_echo"),  # first response only, "" after
    (ENGINE,      OUT, "request_key",             BYTES,  (1,),  False, "_request_key_echo"),
    # kv_role="prefill": the hand-over on the last response (JSON), "" otherwise
    (ENGINE,      OUT, "kv_transfer_params",      BYTES,  (1,),  False, "_kv_transfer_params_out"),
    (POSTPROCESS, IN,  "output_ids",              INT32,  (-1,), False, "_output_ids"),
    (POSTPROCESS, IN,  "logprobs",                BYTES,  (1,),  False, "_logprobs"),
    (POSTPROCESS, IN,  "finish_reason",           BYTES,  (1,),  False, "_finish_reason"),
    (POSTPROCESS, IN,  "num_input_tokens",        INT32,  (1,),  False, "_num_input_tokens"),
    (POSTPROCESS, IN,  "num_output_tokens",       INT32,  (1,),  False, "_num_output_tokens"),
    (POSTPROCESS, IN,  "num_cached_tokens",       INT32,  (1,),  False, "_num_cached_tokens"),
    (POSTPROCESS, IN,  "context",                 BYTES,  (1,),  False, "_context_echo"),
    (POSTPROCESS, IN,  "request_key",             BYTES,  (1,),  False, "_request_key_echo"),
    (POSTPROCESS, IN,  "kv_transfer_params",      BYTES,  (1,),  False, "_kv_transfer_params_out"),
    # API outputs: chunk/event JSONs when streaming (0..n per engine step), the whole response otherwise
    (POSTPROCESS, OUT, "response",                BYTES,  (-1,), False, "response"),
    (POSTPROCESS, OUT, "text_output",             BYTES,  (1,),  False, "text_output"),     # answer-text delta
    (POSTPROCESS, OUT, "num_input_tokens",        INT32,  (1,),  False, "num_input_tokens"),
    (POSTPROCESS, OUT, "num_output_tokens",       INT32,  (1,),  False, "num_output_tokens"),  # cumulative
    (POSTPROCESS, OUT, "finish_reason",           BYTES,  (1,),  False, "finish_reason"),   # "" until the last
    (POSTPROCESS, OUT, "status",                  INT32,  (1,),  False, "status"),          # HTTP status of the API answer
    (POSTPROCESS, OUT, "kv_transfer_params",      BYTES,  (1,),  False, "kv_transfer_params_out"),  # the engine's, unchanged (an ensemble input and output cannot share a name)
))


@dataclass(frozen=True)
class ModelSettings:
    instances: int
    decoupled: bool
    parameters: tuple[tuple[str, str], ...]   # config.pbtxt parameters and their committed defaults
    note: str = ""


# "" for checkpoint = $DEEPINFER_CHECKPOINT, else <repo>/checkpoints/tiny (what `make serve` builds).
SETTINGS = {
    # max_model_len: the same context limit in both (the preprocess caps output limits with it)
    # limits: JSON of deepinfer.recipe.validation.Limits fields (max_request_bytes, max_tokens_cap,
    # default_max_tokens, ...); "{}" = the defaults
    # allow_image_urls: fetch http(s) image URLs (SSRF filtered to public addresses); off = data URLs only
    PREPROCESS: ModelSettings(2, False, (("checkpoint", ""), ("max_model_len", "16384"), ("limits", "{}"),
                                         ("allow_image_urls", "false"), ("max_images_per_request", "16"))),
    ENGINE: ModelSettings(1, True, (("checkpoint", ""), ("engine_args", '{"max_model_len": 16384}'))),
    # NOTE: one instance, no dynamic batcher. Parsing is stateful (one StreamProcessor per request
    # key: tags, tool calls and multi-byte characters span engine steps), so every chunk of a request
    # must reach the same process, in order. Triton keeps a step's response order only for a single
    # instance without a batcher (or preserve_ordering), and routes nothing by key across instances;
    # one instance satisfies both. Parsing costs ~5 us per token, far below an engine step.
    POSTPROCESS: ModelSettings(1, False, (("checkpoint", ""),),
                               "one instance: per-request parse state lives in this process (contract.py)"),
}


def tensors(model: str, io: str) -> list[Tensor]:
    return [t for t in TABLE if t.model == model and t.io == io]


def ensemble_inputs() -> list[Tensor]:
    """The preprocess inputs, under their wire names (all optional: `request` or `text_input`)."""
    return [Tensor(ENSEMBLE, IN, t.wire, t.dtype, t.dims, t.optional, t.wire) for t in tensors(PREPROCESS, IN)]


def ensemble_outputs() -> list[Tensor]:
    return [Tensor(ENSEMBLE, OUT, t.wire, t.dtype, t.dims, False, t.wire) for t in tensors(POSTPROCESS, OUT)]


def names(model: str, io: str) -> list[str]:
    return [t.name for t in tensors(model, io)]
