"""The seam between the engine and the model package: load weights, size and allocate caches."""

from __future__ import annotations

import torch

_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
           "fp16": torch.float16, "float32": torch.float32, "fp32": torch.float32}


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {name!r}") from None


def load_model(checkpoint: str, device: str, dtype: str, overrides: dict | None = None):
    """(Transformer, ModelArgs) from a release-format checkpoint folder."""
    from deepinfer.model.loader import load_model as _load
    torch_dtype(dtype)  # validate early
    model = _load(checkpoint, device=device, progress=False, **(overrides or {}))
    return model, model.args


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
