"""Content addresses of full cache blocks: a hash chain over their tokens (vLLM's block hash).

    block k covers positions k*B .. (k+1)*B-1 of a sequence (B = block_tokens):
    h_0 = H(ROOT(salt),  tokens[0:B],   extra(0))
    h_k = H(h_(k-1),     tokens[kB:(k+1)B], extra(k))

A hash therefore names the block's tokens AND every token before it, so equal hashes mean equal
cached KV (the model is causal). The per-request `cache_salt` enters the root: two salts never
share a block, not even the first. Prompts with images hash their cache keys instead of their
token ids (cache/image_keys.py: span positions keyed by the image's content and offset);
`extra(k)` remains a hook for anything else token ids do not say. BLAKE2b-128 over the raw int64
bytes: collision-safe across tenants, about 1 us per 64-token block.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

import numpy as np

ExtraKeys = Callable[[int], bytes]   # block index -> bytes mixed into that block's hash (b"" = none)


def root_hash(cache_salt: str | None) -> bytes:
    """The chain's parent of block 0: the salt, so different salts never meet."""
    h = hashlib.blake2b(digest_size=16, person=b"deepinfer-root")
    if cache_salt is not None:
        h.update(b"salt:" + cache_salt.encode("utf-8"))
    return h.digest()


def chain_hash(parent: bytes, tokens: Sequence[int], extra: bytes = b"") -> bytes:
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    if extra:
        h.update(b"|x|")
        h.update(extra)
    return h.digest()


def extend_block_hashes(hashes: list[bytes], token_ids: Sequence[int], block_tokens: int,
                        cache_salt: str | None = None, extra_keys: ExtraKeys | None = None) -> list[bytes]:
    """Append the hashes of the full blocks of token_ids not hashed yet (in place; returned)."""
    for k in range(len(hashes), len(token_ids) // block_tokens):
        parent = hashes[k - 1] if k else root_hash(cache_salt)
        hashes.append(chain_hash(parent, token_ids[k * block_tokens:(k + 1) * block_tokens],
                                 extra_keys(k) if extra_keys is not None else b""))
    return hashes
