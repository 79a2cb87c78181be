"""LLM: offline batch generation, vLLM's API shape.

    llm = LLM("checkpoints/tiny", max_num_seqs=16)
    outs = llm.generate([[0, 19, 7], [0, 42]], SamplingParams(max_tokens=32, temperature=0))
    outs[0].token_ids, outs[0].finish_reason

Prompts are token-id lists (the engine holds no tokenizer; the recipe turns text into ids).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from deepinfer.config import EngineArgs
from deepinfer.outputs import CompletionOutput
from deepinfer.sampling_params import SamplingParams


class LLM:
    def __init__(self, checkpoint: str, **engine_args) -> None:
        from deepinfer.engine import Engine
        self.engine = Engine(EngineArgs.from_kwargs(checkpoint, **engine_args))
        self._ids = itertools.count()

    def generate(self, prompts: Sequence[Sequence[int]] | Sequence[int],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 forced_token_ids: Sequence[Sequence[int] | None] | None = None,
                 return_logits: bool = False,
                 images: Sequence[Sequence | None] | None = None,
                 cache_salt: str | None = None) -> list[CompletionOutput]:
        """Run every prompt to completion, all batched together; outputs in prompt order.

        sampling_params: one for all prompts, or one per prompt. forced_token_ids (per prompt):
        teacher forcing, the fed tokens whatever the model samples (scoring). return_logits: each
        output carries the fp32 logits [num_output_tokens, V] its tokens were sampled from.
        images (per prompt): image bytes or ImageInputs, one per image placeholder id in that prompt;
        the outputs' prompt_token_ids then hold the expanded spans.
        cache_salt: with prefix caching, these requests share cached blocks only with requests of the
        same salt. Bad input raises before anything runs.
        """
        if len(prompts) and isinstance(prompts[0], int):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, Sequence) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        forced = forced_token_ids or [None] * len(prompts)
        req_ids = [f"llm-{next(self._ids)}" for _ in prompts]
        images = list(images) if images is not None else [None] * len(prompts)
        if len(images) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(images)} image lists")
        images = [self.engine.prepare_images(rid, p, ims) if ims else None
                  for rid, p, ims in zip(req_ids, prompts, images)]
        prompts = [ip.token_ids if ip is not None else p for p, ip in zip(prompts, images)]
        for rid, p, sp in zip(req_ids, prompts, params):
            self.engine.validate(rid, p, sp)
        for rid, p, sp, f, ip in zip(req_ids, prompts, params, forced, images):
            self.engine.add_request(rid, list(p), sp, forced_token_ids=f, return_logits=return_logits, images=ip,
                                    cache_salt=cache_salt)
        return self._run(req_ids, prompts, return_logits)

    def _run(self, req_ids, prompts, return_logits) -> list[CompletionOutput]:
        results = {rid: CompletionOutput(rid, list(p), [], None, None, [] if return_logits else None)
                   for rid, p in zip(req_ids, prompts)}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                res = results[out.request_id]
                res.token_ids.extend(out.new_token_ids)
                res.finish_reason = out.finish_reason
                res.num_cached_tokens = out.num_cached_tokens
                if out.new_logprobs is not None:
                    res.logprobs = (res.logprobs or []) + list(out.new_logprobs)
                if return_logits and out.logits is not None:
                    res.logits.append(out.logits)
        if return_logits:
            import numpy as np
            for res in results.values():
                res.logits = np.concatenate(res.logits) if res.logits else None
        return [results[rid] for rid in req_ids]

    def stats(self) -> dict:
        return self.engine.stats.snapshot()
