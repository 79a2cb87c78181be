"""Engram: n-gram hash lookups written into the residual stream (reference inference/engram.py and
model.py `Engram`).

Hashing: token ids -> compressed ids (tokens that normalize alike collapse) -> for each position the
ids at p, p-1, .., p-(max_ngram-1), a look-back before position 0 or at/after a dead token (image span)
replaced by the compressed pad id -> multiply by per-layer odd multipliers -> rolling XOR; after each
step i the (i+1)-gram hash mod one prime per head, plus that head's table offset.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import torch
from torch import nn

from deepinfer.host_copy import to_device
from deepinfer.kernels.tensor_version import tensor_version

from .layers import ACT, Linear

DEAD = -2      # ngram_history / token_mask marker: an image-span token (blocks the look-back)
BEFORE = -1    # ngram_history marker: before position 0


def _is_prime(n: int) -> bool:
    from sympy import isprime
    return bool(isprime(n))


def engram_primes(layer_ids, max_ngram_size: int, n_heads: int, vocab_size: int) -> list[list[list[int]]]:
    """[layer][n-gram order][head] primes: from vocab_size-1 upward, next primes never reused across layers."""
    seen, out = set(), []
    for _ in layer_ids:
        per_layer = []
        for _ in range(max_ngram_size - 1):
            cur, heads = vocab_size - 1, []
            for _ in range(n_heads):
                cur += 1
                while not _is_prime(cur) or cur in seen:
                    cur += 1
                seen.add(cur)
                heads.append(cur)
            per_layer.append(heads)
        out.append(per_layer)
    return out


def hash_multipliers(layer_ids, max_ngram_size: int, compressed_vocab: int) -> np.ndarray:
    """[n_layers, max_ngram] odd int64 multipliers from a per-layer RNG (seed 10007 * layer)."""
    bound = max(1, (np.iinfo(np.int64).max // compressed_vocab) // 2)
    rows = [np.random.default_rng(10007 * L).integers(0, bound, size=(max_ngram_size,), dtype=np.int64) * 2 + 1
            for L in layer_ids]
    return np.stack(rows)


def compressed_token_map(tokenizer_json: str | Path) -> tuple[np.ndarray, int]:
    """Every id -> compressed id (first-seen order of the normalized decoded text). Cached on disk by
    the tokenizer file's hash, since decoding 129k tokens one by one takes seconds."""
    raw = Path(tokenizer_json).read_bytes()
    digest = hashlib.sha256(raw).hexdigest()[:32]
    cache_dir = Path(os.environ.get("DEEPINFER_CACHE", Path.home() / ".cache" / "deepinfer"))
    cache = cache_dir / f"engram_token_map_{digest}.npy"
    if cache.is_file():
        lookup = np.load(cache)
        return lookup, int(lookup.max()) + 1
    lookup, size = _build_token_map(str(tokenizer_json))
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".{os.getpid()}.tmp.npy")
        np.save(tmp, lookup)
        os.replace(tmp, cache)
    except OSError:
        pass
    return lookup, size


def _build_token_map(tokenizer_json: str) -> tuple[np.ndarray, int]:
    from tokenizers import Regex, Tokenizer, normalizers

    tok = Tokenizer.from_file(tokenizer_json)
    sentinel = "\ue000"   # keeps a token that is exactly one space from stripping to ""
    norm = normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), sentinel),
        normalizers.Strip(), normalizers.Replace(sentinel, " "),
    ])
    n = tok.get_vocab_size(with_added_tokens=True)
    keys: dict[str, int] = {}
    lookup = np.zeros(n, dtype=np.int64)
    for i in range(n):
        text = tok.decode([i], skip_special_tokens=False)
        if "\ufffd" in text:
            key = tok.id_to_token(i)       # partial UTF-8 byte token: keyed by its raw form
        else:
            key = norm.normalize_str(text) or text
        lookup[i] = keys.setdefault(key, len(keys))
    return lookup, len(keys)


class NgramHasher(nn.Module):
    """Hash ids for a flat batch of new tokens: [T] ids + per-sequence history -> [T, n_layers, cols]."""

    def __init__(self, args, token_map: np.ndarray, compressed_vocab: int):
        super().__init__()
        if compressed_vocab != args.engram_compressed_vocab_size:
            raise ValueError(f"config.json field 'text_config.engram_compressed_vocab_size' is "
                             f"{args.engram_compressed_vocab_size}, but the tokenizer compresses to {compressed_vocab}")
        self.max_ngram = args.engram_max_ngram_size
        primes = engram_primes(args.engram_layer_ids, self.max_ngram, args.engram_n_heads, args.engram_vocab_size)
        sums = [sum(map(sum, p)) for p in primes]
        if tuple(sums) != tuple(args.engram_num_embeddings):
            raise ValueError(f"config.json field 'text_config.engram_num_embeddings' is {list(args.engram_num_embeddings)}"
                             f", but the prime layout gives {sums}")
        flat = [[p for order in layer for p in order] for layer in primes]
        offsets = [np.cumsum([0] + f[:-1]) for f in flat]
        self.pad_id = int(token_map[args.engram_pad_id])
        self.register_buffer("token_map", torch.from_numpy(np.asarray(token_map, dtype=np.int64)), persistent=False)
        self.register_buffer("primes", torch.tensor(primes, dtype=torch.int64), persistent=False)    # [Le, n-1, H]
        self.register_buffer("offsets", torch.tensor(np.array(offsets), dtype=torch.int64), persistent=False)
        self.register_buffer("multipliers", torch.from_numpy(
            hash_multipliers(args.engram_layer_ids, self.max_ngram, compressed_vocab)), persistent=False)

    def forward(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor, history: torch.Tensor,
                token_mask: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [T]; cu_seqlens [B+1]; history [B, max_ngram-1] ids before each chunk (oldest
        first; BEFORE = -1 before position 0, DEAD = -2 image span); token_mask [T] False = dead.
        Returns [T, n_engram_layers, (max_ngram-1) * n_heads] int64 hash ids (offsets included)."""
        from . import ops
        dev = input_ids.device
        # host arrays through pinned memory: a plain .to() of pageable memory waits for the stream
        hist, cu = to_device(history, dev), to_device(cu_seqlens, dev)
        return ops.ngram_hash(input_ids, cu, hist, token_mask, self.token_map, self.multipliers, self.primes,
                              self.offsets, self.pad_id, DEAD)


class EngramTable(nn.Module):
    """FP8 rows with one E8M0 scale per 32 columns, dequantized on lookup (the table stays FP8)."""

    sharded = False

    def __init__(self, rows: int, dim: int):
        super().__init__()
        self.row_range = (0, rows)        # the rows this module holds (the loader reads only those)
        self.register_buffer("weight", torch.empty(rows, dim, dtype=torch.float8_e4m3fn), persistent=False)
        self.register_buffer("scale", torch.empty(rows, dim // 32, dtype=torch.uint8), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [...] -> [..., D] bf16."""
        from . import ops
        return ops.engram_rows(self.weight, self.scale, ids)


class ShardedEngramTable(EngramTable):
    """Rank r holds rows [lo, hi) of the table (an even split, the remainder on the first ranks:
    parallel/planner.engram_rows_of_rank). A lookup all-gathers every rank's hash ids (padded to the
    step's largest rank), dequantizes the rows it holds into zeros elsewhere and reduce-scatters the
    rows back: each row has exactly one non-zero contributor, so the sum is exact and the rows equal
    the whole table's. Equal-size collectives: CUDA-graph safe on NCCL."""

    sharded = True

    def __init__(self, rows: int, dim: int, parallel):
        from deepinfer.parallel.planner import engram_rows_of_rank
        n, r = parallel.world_size, parallel.rank
        lo = sum(engram_rows_of_rank(rows, n, q) for q in range(r))
        super().__init__(engram_rows_of_rank(rows, n, r), dim)
        self.row_range, self.parallel = (lo, lo + engram_rows_of_rank(rows, n, r)), parallel

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        from deepinfer.parallel.ep_comm import all_gather_rows, all_reduce_max, reduce_scatter_rows
        p, (lo, hi) = self.parallel, self.row_range
        T, cols = ids.shape
        M = p.step_max_tokens if p.step_max_tokens is not None else all_reduce_max(T, ids.device, p.group)
        padded = ids.new_full((M, cols), -1)
        padded[:T] = ids
        every = all_gather_rows(padded, p.group, p.world_size)                   # [N*M, cols]
        mine = (every >= lo) & (every < hi)
        rows = torch.zeros(*every.shape, self.weight.shape[1], dtype=ACT, device=ids.device)
        rows[mine] = super().forward(every[mine] - lo)
        return reduce_scatter_rows(rows, p.group, p.world_size)[:T]             # [T, cols, dim]


class Engram(nn.Module):
    """Gated add of the looked-up n-gram value; one key per hc copy, gate = sigmoid(signed sqrt of
    the normalized stream . key dot product)."""

    def __init__(self, args, layer_id: int, parallel=None):
        super().__init__()
        li = args.engram_layer_ids.index(layer_id)
        self.hash_index, self.dim, self.hc_mult, self.eps = li, args.dim, args.hc_mult, args.norm_eps
        rows, hd = args.engram_num_embeddings[li], args.engram_head_dim
        sharded = parallel is not None and parallel.is_parallel and parallel.engram_sharded
        self.embed = ShardedEngramTable(rows, hd, parallel) if sharded else EngramTable(rows, hd)
        self.wkv = Linear(args.n_hash_cols * args.engram_head_dim, args.dim * (args.hc_mult + 1))
        self.register_buffer("q_weight", torch.ones(args.hc_mult, args.dim), persistent=False)
        self.register_buffer("k_weight", torch.ones(args.hc_mult, args.dim), persistent=False)

    def project(self, hash_ids: torch.Tensor) -> torch.Tensor:
        """[T, (hc + 1) d]: the keys and the value of the step's rows. Reads only the hash ids, so a small
        step makes it ahead of the layer, on the side stream (Transformer.forward)."""
        return self.wkv(self.embed(hash_ids).flatten(-2))

    def forward(self, x: torch.Tensor, hash_ids: torch.Tensor, token_mask: torch.Tensor | None,
                kv: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, hc, d] bf16; hash_ids [T, cols] -> [T, hc, d]. kv: project(hash_ids), if made ahead."""
        from . import ops
        kv = self.project(hash_ids) if kv is None else kv
        key, value = kv.split([self.hc_mult * self.dim, self.dim], dim=-1)
        return ops.engram_gate(x, key, value, self._gate_weight(), self.eps, token_mask)

    def _gate_weight(self) -> torch.Tensor:
        """q_weight * k_weight in fp32, computed once per load (three launches a layer and step otherwise)."""
        key = tuple((t.data_ptr(), tensor_version(t)) for t in (self.q_weight, self.k_weight))
        if getattr(self, "_gate_w_key", None) != key:
            self._gate_w = (self.q_weight.float() * self.k_weight.float()).contiguous()
            self._gate_w_key = key
        return self._gate_w
