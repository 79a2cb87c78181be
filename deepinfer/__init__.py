"""DeepInfer: the DeepSeek-V4.1-Flash engine behind the Triton models.

Public API (vLLM-like):
    LLM(checkpoint, **engine_args).generate(prompt_token_ids_list, SamplingParams(...))
        -> list[CompletionOutput] (token_ids, finish_reason, logprobs)
    AsyncEngine(EngineArgs(...)): async generate(...) of RequestOutput deltas, add_request(...,
        callback) / stream(...) from plain threads, abort(request_id), stats()
    EngineArgs, SamplingParams, OutputConstraint, RequestOutput, CompletionOutput,
    InvalidRequestError, UnknownRequestError, EngineDeadError

Imports are lazy so that `import deepinfer.recipe` (and friends) does not import torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "LLM": "deepinfer.llm",
    "AsyncEngine": "deepinfer.async_engine",
    "Engine": "deepinfer.engine",
    "EngineArgs": "deepinfer.config",
    "SamplingParams": "deepinfer.sampling_params",
    "OutputConstraint": "deepinfer.sampling_params",
    "RequestOutput": "deepinfer.outputs",
    "CompletionOutput": "deepinfer.outputs",
    "InvalidRequestError": "deepinfer.request",
    "UnknownRequestError": "deepinfer.request",
    "EngineDeadError": "deepinfer.request",
    "EngineStats": "deepinfer.stats",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'deepinfer' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + __all__)
