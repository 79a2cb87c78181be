"""Engine token ids -> API response chunks: one deepseek-recipe StreamProcessor per request.

`ResponseStream` is built from the RequestContext the engine echoed. Each `push` takes one engine
response (the new token ids, their logprobs, and the engine's finish reason once it is done) and
returns the chunk JSONs to send (SSE-ready, in the request's own format), the plain answer-text
delta, and whether a stop sequence ended the answer before the engine did (the caller then stops the
engine request). A non-streaming request gets one push and answers with the whole response, built
with the recipe's own response class.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import deepseek_recipe as dr

from .context import TEXT_API, RequestContext
from .errors import error_body
from .preprocess import EOS_TOKEN_ID, REQUEST_CLASSES, conversion_options
from .token_bytes import TokenBytes

RESPONSE_CLASSES = {"chat.completions": dr.ChatCompletionResponse, "responses": dr.ResponsesResponse,
                    "messages": dr.MessagesResponse}
# engine finish reason -> recipe finish reason; the protocol's reason comes from the parse.
FINISH_REASONS = {"length": dr.InferenceFinishReason.Length,
                  "content_filter": dr.InferenceFinishReason.ContentFilter}


@dataclass
class StepOutput:
    chunks: list[str] = field(default_factory=list)   # chunk / event JSONs, or the whole response
    text: str = ""                                    # answer-text delta (content only)
    done: bool = False                                # the API response is complete
    stopped: bool = False                             # a stop sequence ended it: stop the engine
    num_output_tokens: int = 0                        # tokens parsed so far (= usage.completion_tokens)
    finish_reason: str = ""                           # set once done


class ResponseStream:
    def __init__(self, ctx: RequestContext, tokenizer: dr.Tokenizer, options: dr.ConversionOptions | None = None,
                 token_bytes: TokenBytes | None = None, cached_tokens: int = 0):
        self.ctx = ctx
        self.num_output_tokens = 0
        self.token_bytes = token_bytes          # counts back ids of a character cut off at the end
        self._last_ids: list[int] = []
        self._pending_input_text = ctx.input_text
        self.processor = _stream_processor(ctx, tokenizer, options or conversion_options())
        self.response = None
        if not ctx.stream and ctx.api != TEXT_API:
            self.response = RESPONSE_CLASSES[ctx.api](ctx.response_id, ctx.model, int(time.time()),
                                                      ctx.prompt_tokens, 0)
        # prompt tokens the engine's prefix cache served: the recipe reports them in each API's usage
        # (prompt_tokens_details.cached_tokens, input_tokens_details.cached_tokens, cache_read_input_tokens)
        usage = dr.PromptUsage(prompt_tokens=ctx.prompt_tokens, prompt_cache_hit_tokens=min(cached_tokens, ctx.prompt_tokens))
        self._ready = self.processor.push(dr.InferenceChunk.ready(prompt_usage=usage))

    @property
    def done(self) -> bool:
        return self.processor.finished

    def push(self, token_ids: list[int], logprobs=None, finish_reason: str | None = None) -> StepOutput:
        """token_ids: this engine response's new ids; logprobs: None or one (lp, [(id, lp)]) per id."""
        out = StepOutput()
        if self.processor.finished:          # already ended by a stop sequence: drop the rest
            out.done = True
            return out
        protocol_chunks, self._ready = self._ready, []
        if token_ids:
            self.num_output_tokens += len(token_ids)
            self._last_ids = (self._last_ids + list(token_ids))[-4:]
            protocol_chunks += self._push_ids(list(token_ids), logprobs)
        by_stop_sequence = self.processor.finished
        out.stopped = by_stop_sequence and not finish_reason   # the engine is still generating
        if finish_reason and not self.processor.finished:
            text_ids = self._last_ids[:-1] if self._last_ids[-1:] == [EOS_TOKEN_ID] else self._last_ids
            cut = self.token_bytes.incomplete_tail(text_ids) if self.token_bytes is not None else 0
            if cut:   # the recipe drops a character cut off at the end without counting its ids
                protocol_chunks += self.processor.push(dr.InferenceChunk.text("", token_count=cut))
            reason = FINISH_REASONS.get(finish_reason, dr.InferenceFinishReason.Stop)
            protocol_chunks += self.processor.push(dr.InferenceChunk.finish(reason))
            protocol_chunks += self.processor.finish()
        out.done = self.processor.finished
        self._emit(protocol_chunks, out)
        out.num_output_tokens = self.num_output_tokens
        if out.done:
            out.finish_reason = "stop" if by_stop_sequence else (finish_reason or "stop")
        return out

    def _push_ids(self, ids: list[int], logprobs) -> list:
        """NOTE: the recipe decodes EOS into visible text; the engine stops on it, so it can only be
        last. It is counted (usage = the engine's token count) through an empty text chunk."""
        eos = ids[-1] == EOS_TOKEN_ID
        if eos:
            ids, logprobs = ids[:-1], (logprobs[:-1] if logprobs else logprobs)
        # One id per push: the recipe holds back a whole multi-id chunk that ends inside a UTF-8
        # character and drops it at finish, so grouping would change the text (a complete response
        # would lose a step's worth of tokens that the same request streamed).
        chunks = []
        for i, token_id in enumerate(ids):
            if self.processor.finished:   # a stop sequence matched: the ids after it are not part of the answer
                return chunks
            lp = logprobs[i:i + 1] if logprobs else logprobs
            chunks += self.processor.push(dr.InferenceChunk.tokens([token_id], lp))
        if eos and not self.processor.finished:
            chunks += self.processor.push(dr.InferenceChunk.text("", token_count=1))
        return chunks

    def close(self) -> None:
        self.processor.close()

    def _emit(self, protocol_chunks: list, out: StepOutput) -> None:
        texts = []
        for chunk in protocol_chunks:
            data = mend_usage(chunk.to_json())
            texts.append(answer_text(self.ctx.api, data))
            if self.response is not None:
                self.response.accumulate(chunk)
            elif self.ctx.api != TEXT_API:
                out.chunks.append(data)
        if self._pending_input_text:
            texts.insert(0, self._pending_input_text)
            self._pending_input_text = ""
        out.text = "".join(texts)
        if self.response is not None and out.done:
            out.chunks.append(mend_usage(self.response.to_json()))


def mend_usage(data: str) -> str:
    """Two mends of deepseek-recipe 0.2.0's usage objects, in every chunk, event and response:
    - it counts a token that decodes to an invalid UTF-8 sequence twice in `reasoning_tokens` (one id ->
      2), so usage could say 33 reasoning tokens of 32; reasoning tokens are a part of the completion
      tokens, so cap them there (the official APIs' invariant);
    - its Responses usage has no `input_tokens_details.cache_write_tokens`, which the OpenAI SDK (3.5x on)
      declares required (reading it raised AttributeError): 0, as OpenAI reports for its automatic prompt
      caching, whose writes are free; the prefix cache is automatic (the reads stay in `cached_tokens`)."""
    if "reasoning_tokens" not in data and "input_tokens_details" not in data:
        return data
    obj = json.loads(data)
    for usage in _usages(obj):
        details = usage.get("completion_tokens_details") or usage.get("output_tokens_details")
        total = usage.get("completion_tokens", usage.get("output_tokens"))
        if isinstance(details, dict) and isinstance(total, int) and (details.get("reasoning_tokens") or 0) > total:
            details["reasoning_tokens"] = total
        if isinstance(usage.get("input_tokens_details"), dict):
            usage["input_tokens_details"].setdefault("cache_write_tokens", 0)
    return json.dumps(obj, ensure_ascii=False)


def _usages(obj: dict) -> list[dict]:
    """The usage objects of a chunk, event or response (Responses events nest it in `response`)."""
    found = [obj.get("usage")] + [(obj.get("response") or {}).get("usage")]
    return [u for u in found if isinstance(u, dict)]


def answer_text(api: str, chunk_json: str) -> str:
    """The answer-text delta of one chunk (no reasoning, no tool calls): what `text_output` carries."""
    chunk = json.loads(chunk_json)
    if api in ("chat.completions", TEXT_API):
        choices = chunk.get("choices") or [{}]
        return (choices[0].get("delta") or {}).get("content") or ""
    if api == "responses":
        return chunk.get("delta", "") if chunk.get("type") == "response.output_text.delta" else ""
    if chunk.get("type") == "content_block_delta" and chunk["delta"].get("type") == "text_delta":
        return chunk["delta"]["text"]
    return ""


def _stream_processor(ctx: RequestContext, tokenizer, options) -> dr.StreamProcessor:
    if ctx.api == TEXT_API:
        # Plain text: the Chat generator without thinking or tool parsing decodes ids incrementally
        # (multi-byte characters held until complete) and applies the stop words.
        conv = dr.ConversationRequest(dr.Conversation([], thinking_mode=False), dr.ModelVersion.DeepseekV41Flash)
        gen = dr.ChatCompletionRequest.chunk_generator(conv, ctx.response_id, ctx.model)
        parsing = dr.ParsingOptions(parse_tool_calls=False, stop_sequences=ctx.stop_words)
        return dr.StreamProcessor(gen, parsing, tokenizer)
    request = REQUEST_CLASSES[ctx.api](ctx.body)
    extras = {}
    if ctx.api == "responses":   # read before convert consumes the request
        extras = {"tool_map": request.namespace_tool_map(options), "echo": request.echo()}
    conv = request.convert(options)
    gen = REQUEST_CLASSES[ctx.api].chunk_generator(conv, ctx.response_id, ctx.model)
    if extras:
        gen = gen.with_namespace_tool_map(extras["tool_map"]).with_echo(extras["echo"])
    return dr.StreamProcessor(gen, conv.parsing_options, tokenizer)


class Postprocessor:
    """The ResponseStreams of the requests in flight, keyed by request key.

    A stream is created from the context the engine echoes on its first response and dropped on the
    last. A request whose engine stream ended in a Triton error never reaches the postprocess again,
    so streams idle for `max_idle_s` are evicted.
    """

    def __init__(self, tokenizer_path: str, max_idle_s: float = 600.0):
        self.tokenizer = dr.Tokenizer.from_file(str(tokenizer_path))
        self.token_bytes = TokenBytes.from_file(tokenizer_path)
        self.options = conversion_options()
        self.max_idle_s = max_idle_s
        self.streams: dict[str, tuple[ResponseStream, float]] = {}

    def process(self, inputs: dict) -> tuple[dict, bool]:
        """One engine response (postprocess inputs by contract name) -> (outputs, stop_engine)."""
        outputs, stop_engine = self._process(inputs)
        # a prefill replica's hand-over goes out as the engine wrote it (the router passes it on)
        outputs["kv_transfer_params"] = inputs.get("kv_transfer_params") or ""
        return outputs, stop_engine

    def _process(self, inputs: dict) -> tuple[dict, bool]:
        key, context = inputs["request_key"], inputs.get("context") or ""
        finish_reason = inputs.get("finish_reason") or None
        if context:
            ctx = RequestContext.from_json(context)
            if ctx.error_status:
                body = ctx.error_body or error_body(ctx.api, ctx.error_status, ctx.error_message)
                return _outputs([body], "", ctx.prompt_tokens, 0, "error", ctx.error_status), False
            stream = ResponseStream(ctx, self.tokenizer, self.options, self.token_bytes,
                                    cached_tokens=int(inputs.get("num_cached_tokens") or 0))
            self.streams[key] = (stream, time.monotonic())
        entry = self.streams.get(key)
        if entry is None:   # evicted, or the stream already ended on a stop sequence
            return _outputs([], "", inputs.get("num_input_tokens") or 0, inputs.get("num_output_tokens") or 0,
                            finish_reason or "", 200), False
        stream = entry[0]
        lp = json.loads(inputs["logprobs"]) if inputs.get("logprobs") else None
        if lp is not None:
            lp = [(p, [tuple(a) for a in top]) for p, top in lp]
        step = stream.push(list(inputs.get("output_ids") or []), lp, finish_reason)
        if step.done:
            stream.close()
            self.streams.pop(key, None)
        else:
            self.streams[key] = (stream, time.monotonic())
        self._evict_idle()
        # the engine's own counts (the recipe's usage counts the same tokens, unless a stop sequence cut them)
        return _outputs(step.chunks, step.text, inputs.get("num_input_tokens") or stream.ctx.prompt_tokens,
                        inputs.get("num_output_tokens") or step.num_output_tokens, step.finish_reason, 200), step.stopped

    def _evict_idle(self) -> None:
        now = time.monotonic()
        for key in [k for k, (_, t) in self.streams.items() if now - t > self.max_idle_s]:
            self.streams.pop(key)[0].close()


def _outputs(chunks, text, num_input_tokens, num_output_tokens, finish_reason, status) -> dict:
    return {"response": chunks, "text_output": text, "num_input_tokens": num_input_tokens,
            "num_output_tokens": num_output_tokens, "finish_reason": finish_reason, "status": status}
