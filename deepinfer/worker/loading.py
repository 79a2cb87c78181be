"""The seam between the engine and the model package: dtypes, cache sizes, cache allocation (the weights
are loaded by model/loader.py, called from worker/rank.py)."""

from __future__ import annotations

import torch

_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
           "fp16": torch.float16, "float32": torch.float32, "fp32": torch.float32}


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {name!r}") from None


def cache_bytes_per_block(model_args, block_tokens: int, dtype: str) -> int:
    from deepinfer.cache.model_caches import ModelCaches
    return ModelCaches.bytes_per_block(model_args, block_tokens, torch_dtype(dtype))


def ring_slot_bytes(model_args, dtype: str) -> int:
    from deepinfer.cache.model_caches import ModelCaches
    return ModelCaches.bytes_per_ring_slot(model_args, torch_dtype(dtype))


def allocate_caches(model_args, num_ring_slots: int, num_blocks: int, block_tokens: int, device: str, dtype: str,
                    scratch: bool = False):
    from deepinfer.cache.model_caches import ModelCaches
    return ModelCaches.allocate(model_args, num_ring_slots, num_blocks, block_tokens, device, torch_dtype(dtype),
                                scratch=scratch)
