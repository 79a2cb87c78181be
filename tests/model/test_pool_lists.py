"""A decode layer's attention lists in pool rows (ops.pool_lists, Attention._attend_step's in-place path)
point at exactly the rows the buffer-coordinate lists did: window lists through the per-step table
(StepMetadata.window_pool), then each row's compressed picks through the block tables
(Attention._compressed_rows' decode branch), appended after the row's own window list."""

from types import SimpleNamespace

import numpy as np
import torch

from deepinfer.kernels.reference import pool_lists_ref
from deepinfer.model.attention import Attention, append_lists
from deepinfer.model.step_metadata import StepMetadata


def _meta(B=5, window=8, ring_len=8, K=6, E=40, epb=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    T, wr = B, window - 1
    ring_rows = 11 * ring_len
    nb = -(-E // epb) + 1
    block_tables = torch.randint(-1, 50, (B, nb), generator=g)
    win_len = torch.randint(1, window + 1, (T,), generator=g)
    win_idx = torch.randint(0, B * wr + T, (T, window), generator=g)
    win_idx = torch.where(torch.arange(window)[None, :] < win_len[:, None], win_idx, -1)
    win_idx[0, 0] = -1                                         # a pad inside the list (decode layout)
    topk = torch.randint(0, E, (T, K), generator=g)
    topk[1, 2:] = -1                                           # unreachable picks
    meta = StepMetadata(num_seqs=B, num_tokens=T, max_q=1, window=window, ring_len=ring_len, starts=None, ends=None,
                        cu=None, positions=torch.zeros(T, dtype=torch.long), positions_host=np.zeros(T),
                        seq_of=torch.arange(T), row_in_seq=torch.zeros(T, dtype=torch.long),
                        ring_slots=torch.arange(B), block_tables=block_tables, ring_width=wr,
                        ring_read=torch.randint(0, ring_rows, (B * wr,), generator=g), win_idx=win_idx,
                        win_len=win_len, ring_write_rows=None, ring_write=torch.arange(B), last_pos=0)
    return meta, topk, ring_rows, epb, E


def test_pool_lists_match_the_buffer_lists():
    for seed in range(4):
        meta, topk, ring_rows, epb, E = _meta(seed=seed)
        T = meta.num_tokens
        assert topk.numel() < meta.num_seqs * E                 # the decode branch
        # the buffer-coordinate lists and their buffer -> pool table (Attention._attend)
        fake = SimpleNamespace(kv_source=0)
        caches = SimpleNamespace(entries_per_block=lambda layer: epb)
        rows, comp = Attention._compressed_rows(fake, meta, caches, topk, E)
        idx = append_lists(meta.win_idx, meta.win_len, comp)
        table = torch.cat([meta.ring_read, ring_rows + torch.arange(T), ring_rows + T + rows])
        want = torch.where(idx >= 0, table[idx.clamp_min(0)], -1)
        got = pool_lists_ref(meta.window_pool(ring_rows), meta.win_len, topk, meta.seq_of, meta.block_tables, epb,
                             ring_rows + T)
        assert torch.equal(got, want), seed
