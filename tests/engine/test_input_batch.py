import numpy as np
import torch

from deepinfer.outputs import CachedRequestData, NewRequestData
from deepinfer.sampling_params import SamplingParams
from deepinfer.worker.input_batch import InputBatch


def new(req_id, toks, computed, blocks, slot):
    return NewRequestData(req_id, toks, len(toks), computed, SamplingParams(), blocks, slot)


def test_build_mixed_step():
    ib = InputBatch(max_num_seqs=4, max_model_len=64, max_blocks_per_req=16, ngram_width=3)
    ib.add(new("a", list(range(100, 110)), 0, [3, 4, 5], 2))          # prefill chunk of 4
    ib.add(new("b", list(range(200, 210)), 9, [7, 8, 9], 0))          # decode of position 9
    ib.add(new("c", list(range(300, 306)), 5, [1, 2], 1))             # decode + 2 drafts
    ib.write_drafts("c", [901, 902])
    batch, rows, num_logits = ib.build(["a", "b", "c"], np.array([4, 1, 3]), np.array([0, 0, 2]), "cpu")
    assert batch.cu_seqlens.tolist() == [0, 4, 5, 8]
    assert batch.positions.tolist() == [0, 1, 2, 3, 9, 5, 6, 7]
    assert batch.input_ids.tolist() == [100, 101, 102, 103, 209, 305, 901, 902]
    assert batch.ngram_history.tolist() == [[-1, -1, -1], [206, 207, 208], [302, 303, 304]]
    assert num_logits.tolist() == [0, 1, 3]
    assert batch.logits_indices.tolist() == [4, 5, 6, 7]
    assert batch.ring_slots.tolist() == [2, 0, 1]
    assert batch.block_tables.tolist() == [[3, 4, 5], [7, 8, 9], [1, 2, -1]]
    assert batch.start_pos.tolist() == [0, 9, 5]


def test_rollback_truncates_block_table_and_rows_are_reused():
    ib = InputBatch(max_num_seqs=2, max_model_len=64, max_blocks_per_req=16, ngram_width=3)
    ib.add(new("a", [1, 2, 3], 0, [3, 4, 5], 0))
    ib.update(CachedRequestData("a", 3, 1, [6]))
    assert ib.block_table[ib.row_of["a"], :4].tolist() == [3, 6, -1, -1]
    ib.append_tokens(np.array([ib.row_of["a"]]), [[9]])
    assert ib.num_tokens[ib.row_of["a"]] == 4
    ib.remove("a")
    ib.add(new("b", [5], 0, [], 0))
    assert (ib.block_table[ib.row_of["b"]] == -1).all()
