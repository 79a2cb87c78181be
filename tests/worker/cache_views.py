"""What a sequence owns in ModelCaches, tensor by tensor (graph tests compare caches bit for bit)."""

from __future__ import annotations


def owned_cache_tensors(caches):
    """(name, tensor) of every cache tensor without the scratch slot / block."""
    slot, block = caches.scratch_slot, caches.scratch_block
    for i, t in enumerate(caches.window_kv):
        yield f"window_kv[{i}]", t[:slot]
    for name in ("carry_kv", "carry_score"):
        for s, t in getattr(caches, name).items():
            yield f"{name}[{s}]", t[:slot]
    for name in ("compressed_kv", "index_k"):
        for s, t in getattr(caches, name).items():
            yield f"{name}[{s}]", t[:block]
