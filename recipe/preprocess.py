"""API request -> prompt token ids + sampling parameters, on the official deepseek-recipe 0.2.0.

Chat Completions, Responses and Anthropic Messages bodies are first checked by recipe/validation
(each API's official ranges and the operator's Limits, before any conversion), then converted by the
recipe's own request classes, rendered with `DeepseekV41Encoding` and tokenized with the checkpoint's `tokenizer.json`;
`resolve_max_tokens` applies the default output limits (8,192; 65,536 thinking; 131,072 thinking at
max effort) capped by the context left. The TensorRT-LLM style `text_input` path tokenizes raw text.
Rejections never raise: they come back as a PreparedRequest whose context carries the API's error
body and status, so the ensemble answers them as a normal (single, final) response.
"""

from __future__ import annotations

import json
import math
import uuid

import deepseek_recipe as dr
import numpy as np

from .context import API_KINDS, TEXT_API, PreparedRequest, RequestContext
from .errors import RecipeError, api_error, from_conversion_error
from .images import ImageLimits, ImageStage, image_placeholder
from .validation import Limits, validate_request

MODEL_NAMES = ("deepseek-flash", "DeepSeek-V4.1-Flash", "deepseek_v41_flash")
REQUEST_CLASSES = {"chat.completions": dr.ChatCompletionRequest, "responses": dr.ResponsesRequest,
                   "messages": dr.MessagesRequest}
BOS_TOKEN_ID = 0
EOS_TOKEN_ID = 1
DEFAULT_TEXT_MAX_TOKENS = 8192   # the recipe's non-thinking default, for text_input requests
IMAGE_TOKEN_ID = dr.IMAGE_SPECIAL_TOKEN_ID   # 129264: one per image in the rendered prompt


def conversion_options(model_names=MODEL_NAMES, special_tokens=None) -> dr.ConversionOptions:
    """Accept only our served names (the default table also admits DeepSeek-V4-Pro, which we lack)."""
    table = {name: dr.ModelVersion.DeepseekV41Flash for name in model_names}
    opts = dr.ConversionOptions().with_model_versions_by_name(table)
    return opts if special_tokens is None else opts.with_special_tokens(special_tokens)


def special_tokens(tokenizer_path) -> dr.SpecialTokens | None:
    """The image placeholder as the checkpoint's tokenizer spells id 129264 (the recipe's default
    spelling <｜image｜> is id 129279 in the V4.1 vocabulary), for conversion and rendering alike."""
    name = image_placeholder(tokenizer_path, IMAGE_TOKEN_ID)
    return dr.SpecialTokens(image=name) if name else None


def _constraint(opts: dr.InferenceOptions, thinking: bool) -> dict | None:
    """Recipe OutputConstraint -> deepinfer OutputConstraint kwargs (its `from_recipe` mapping).

    `tool_call` (tool_choice auto) allows text, then optionally one DSML calls block;
    `tool_call_required` starts inside the `<｜DSML｜ calls>` block the prompt opened.
    """
    c = opts.output_constraint
    if c is None:
        return None
    kinds = {"json": "json_schema" if c.schema else "json_object", "regex": "regex",
             "tool_call": "tool_calls", "tool_call_required": "tool_calls"}
    if c.kind not in kinds:
        raise api_error("chat.completions", 400, f"unsupported output constraint {c.kind!r}")
    return {"kind": kinds[c.kind], "spec": c.schema, "after_think": thinking,
            "tool_choice": "required" if c.kind == "tool_call_required" else "auto"}


def sampling_kwargs(opts: dr.InferenceOptions, max_tokens: int, thinking: bool) -> dict:
    """The recipe's resolved options as deepinfer.SamplingParams keyword arguments."""
    return {
        "max_tokens": max_tokens,
        "temperature": 1.0 if opts.temperature is None else float(opts.temperature),
        "top_p": 1.0 if opts.top_p is None else float(opts.top_p),
        "seed": opts.seed,
        "stop_token_ids": [EOS_TOKEN_ID],
        "logprobs": (opts.top_logprobs or 0) if opts.logprobs else None,
        "constraint": _constraint(opts, thinking),
    }


class Preprocessor:
    """Stateless after construction; one per preprocess instance (the tokenizer takes ~0.4 s to load)."""

    def __init__(self, tokenizer_path: str, max_model_len: int, model_names=MODEL_NAMES, limits: Limits | None = None,
                 prepare_image=None, image_limits: ImageLimits | None = None):
        """limits: the operator's request limits (recipe/validation.py); prepare_image(bytes, max_side)
        -> (pixels, span_len): the checkpoint's image plan (recipe/images.py); None refuses images (a
        text-only checkpoint)."""
        self.tokenizer = dr.Tokenizer.from_file(str(tokenizer_path))
        self._tokenizer_path = str(tokenizer_path)
        st = special_tokens(tokenizer_path)
        self.encoding = dr.DeepseekV41Encoding().with_tokenizer(self.tokenizer)
        if st is not None:
            self.encoding = self.encoding.with_special_tokens(st)
        self.model_names = tuple(model_names)
        self.options = conversion_options(model_names, st)
        self.max_model_len = int(max_model_len)
        self.limits = limits or Limits()
        self.images = ImageStage(prepare_image, image_limits)

    # -- the three APIs -------------------------------------------------------------------------
    def prepare(self, api: str, body: bytes | str) -> PreparedRequest:
        ctx = RequestContext(api=api if api in API_KINDS else "chat.completions",
                             response_id=_new_id(api))
        try:
            if api not in API_KINDS:
                raise api_error(ctx.api, 400, f"unknown api {api!r}; expected one of {', '.join(API_KINDS)}")
            # the official ranges and the operator's limits, before any conversion or tokenization
            ctx.body = validate_request(api, body, self.model_names, self.limits)
            conv, ctx.model = self._convert(api, ctx.body)
            ctx.stream = conv.stream
            ids = self.encoding.encode(conv.conversation)
            images = self._images(api, conv, ids)
            ctx.prompt_tokens = len(ids) + (images.token_adjustment if images else 0)   # spans counted in full
            max_tokens = _resolve(api, conv, ctx.prompt_tokens, self.max_model_len)
            sampling = sampling_kwargs(conv.inference_options, max_tokens, conv.conversation.thinking_mode)
            salt = _cache_salt(api, ctx.body)
            if salt is not None:
                sampling["cache_salt"] = salt
        except RecipeError as e:
            return _rejected(ctx, e)
        except UnicodeDecodeError as e:
            return _rejected(ctx, api_error(ctx.api, 400, f"request body is not UTF-8: {e}"))
        return PreparedRequest(uuid.uuid4().hex, ids, sampling, ctx.stream, ctx, images)

    def _images(self, api: str, conv, ids: list[int]):
        """The request's images (recipe/images.py), or None for a text prompt. A placeholder typed in
        text stays text, so the id appears only for real image parts."""
        if IMAGE_TOKEN_ID not in ids:
            return None
        sources = self.encoding.render_conversation(conv.conversation).image_sources
        return self.images.resolve(api, sources)

    def _convert(self, api: str, body: str):
        try:
            request = REQUEST_CLASSES[api](body)
            model = request.model
            return request.convert(self.options), model
        except dr.ConversionError as e:
            raise from_conversion_error(api, e) from e
        except (ValueError, TypeError) as e:   # malformed JSON, missing fields, wrong types
            raise api_error(api, 400, str(e)) from e

    # -- TensorRT-LLM style inputs ------------------------------------------------------------
    def prepare_text(self, text_input: str | bytes, max_tokens: int | None = None, stream: bool = False,
                     temperature: float | None = None, top_p: float | None = None,
                     top_k: int | None = None, seed: int | None = None,
                     stop_words: list[str] | None = None,
                     exclude_input_in_output: bool = True) -> PreparedRequest:
        """Raw text (already rendered by the client, as Triton's OpenAI frontend does); BOS added."""
        ctx = RequestContext(api=TEXT_API, response_id=_new_id(TEXT_API), stream=bool(stream))
        try:
            text_input, stop_words = _check_text_inputs(text_input, stop_words, self.limits)
            sampling = _text_sampling(max_tokens, temperature, top_p, top_k, seed)
            ctx.stop_words = stop_words
            ctx.input_text = "" if exclude_input_in_output else text_input
            ids = self.tokenizer.encode(text_input)
            if not ids or ids[0] != BOS_TOKEN_ID:
                ids = [BOS_TOKEN_ID] + ids
            ctx.prompt_tokens = len(ids)
            left = self.max_model_len - len(ids)
            if left < 1 or (max_tokens is not None and max_tokens > left):
                raise api_error(TEXT_API, 400, f"This model's maximum context length is {self.max_model_len} "
                                f"tokens; the prompt has {len(ids)} and {max_tokens} were requested.")
            if max_tokens is None:
                default = self.limits.default_max_tokens or DEFAULT_TEXT_MAX_TOKENS
                sampling["max_tokens"] = min(default, left)
        except RecipeError as e:
            return _rejected(ctx, e)
        return PreparedRequest(uuid.uuid4().hex, ids, sampling, ctx.stream, ctx)


def _check_text_inputs(text_input, stop_words, limits: Limits) -> tuple[str, list[str]]:
    """The TensorRT-LLM style text and stop words: UTF-8, within the operator's size limits."""
    raw = text_input if isinstance(text_input, bytes) else text_input.encode("utf-8", "surrogatepass")
    if len(raw) > limits.max_request_bytes:
        raise api_error(TEXT_API, 413, f"text_input of {len(raw)} bytes exceeds this deployment's limit of "
                                       f"{limits.max_request_bytes} bytes.")
    words = list(stop_words or [])
    if len(words) > limits.max_stop_sequences:
        raise api_error(TEXT_API, 400, f"stop_words: {len(words)} given, at most {limits.max_stop_sequences} allowed.")
    try:
        text = raw.decode("utf-8")
        words = [w.decode("utf-8") if isinstance(w, bytes) else w for w in words]
    except UnicodeDecodeError as e:
        raise api_error(TEXT_API, 400, f"text_input and stop_words must be valid UTF-8 ({e.reason}).") from None
    if any(not w for w in words):
        raise api_error(TEXT_API, 400, "stop_words: an empty stop word would end every answer at once.")
    return text, words


def _text_sampling(max_tokens, temperature, top_p, top_k, seed) -> dict:
    """The TensorRT-LLM style sampling inputs, checked (0 is a value, not "absent")."""
    checks = [("max_tokens", max_tokens, lambda v: v >= 1, ">= 1"),
              ("temperature", temperature, lambda v: math.isfinite(v) and 0 <= v <= 2, "in [0, 2]"),
              ("top_p", top_p, lambda v: math.isfinite(v) and 0 < v <= 1, "in (0, 1]"),
              ("top_k", top_k, lambda v: v >= 0, ">= 0")]
    for name, value, ok, rule in checks:
        if value is not None and not ok(value):
            raise api_error(TEXT_API, 400, f"{name} must be {rule}, got {value}.")
    return {"max_tokens": max_tokens, "temperature": 1.0 if temperature is None else float(temperature),
            "top_p": 1.0 if top_p is None else float(top_p), "top_k": int(top_k or 0), "seed": seed,
            "stop_token_ids": [EOS_TOKEN_ID], "logprobs": None, "constraint": None}


def _resolve(api: str, conv, num_prompt_tokens: int, max_model_len: int) -> int:
    try:
        return conv.resolve_max_tokens(num_prompt_tokens, max_model_len)
    except dr.ConversionError as e:
        raise from_conversion_error(api, e) from e


def _cache_salt(api: str, body: str) -> str | None:
    """vLLM's `cache_salt` body field: the engine's prefix cache shares blocks only within one salt
    (a tenant key). Travels to the engine in the sampling JSON."""
    salt = json.loads(body).get("cache_salt") if body.lstrip().startswith("{") else None
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise api_error(api, 400, f"cache_salt must be a non-empty string, got {json.dumps(salt)}")
    return salt


def _rejected(ctx: RequestContext, err: RecipeError) -> PreparedRequest:
    ctx.error_status, ctx.error_body = err.status, err.body
    return PreparedRequest(uuid.uuid4().hex, [], {}, ctx.stream, ctx)


def _new_id(api: str) -> str:
    prefix = {"chat.completions": "chatcmpl-", "responses": "resp_", "messages": "msg_"}.get(api, "cmpl-")
    return prefix + uuid.uuid4().hex


def prepare_inputs(pre: Preprocessor, inputs: dict) -> PreparedRequest:
    """Dispatch on the preprocess inputs (contract names, plain Python values, None when absent);
    a client-chosen `request_key` replaces the generated one."""
    prepared = _prepare_inputs(pre, inputs)
    if inputs.get("request_key"):
        prepared.request_key = inputs["request_key"]
    if inputs.get("kv_transfer_params") and not prepared.rejected:
        prepared.kv_transfer_params = inputs["kv_transfer_params"]   # the engine checks it
    return prepared


def _prepare_inputs(pre: Preprocessor, inputs: dict) -> PreparedRequest:
    if inputs.get("request") is not None:
        return pre.prepare(inputs.get("api") or "chat.completions", inputs["request"])
    if inputs.get("text_input") is None:
        ctx = RequestContext(api="chat.completions", response_id=_new_id("chat.completions"))
        return _rejected(ctx, api_error(ctx.api, 400, "either `request` (with `api`) or `text_input` is required"))
    stop_words = inputs.get("stop_words")
    return pre.prepare_text(inputs["text_input"], max_tokens=inputs.get("max_tokens"),
                            stream=bool(inputs.get("stream")), temperature=inputs.get("temperature"),
                            top_p=inputs.get("top_p"), top_k=inputs.get("top_k"), seed=inputs.get("seed"),
                            stop_words=[stop_words] if isinstance(stop_words, str) else stop_words,
                            exclude_input_in_output=inputs.get("exclude_input_in_output") is not False)


def preprocess_outputs(prepared: PreparedRequest) -> dict:
    """The preprocess outputs by contract name."""
    images = prepared.images.contract_values() if prepared.images is not None else \
        {"image_pixels": np.zeros(0, np.uint8), "image_sizes": []}
    return {"input_ids": prepared.prompt_token_ids, "sampling": json.dumps(prepared.sampling),
            "streaming": prepared.stream, "context": prepared.context.to_json(),
            "request_key": prepared.request_key, "kv_transfer_params": prepared.kv_transfer_params, **images}
