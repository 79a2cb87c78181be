"""model/yoco.py's row plan on a synthetic step of four sequences: which rows the decoder layers run,
their new starts, window floors and logits rows (no model needed)."""

import numpy as np
import torch

from deepinfer.model.batch import ForwardBatch
from deepinfer.model.yoco import check_yoco, decoder_start, plan_compaction


def batch(starts, q_lens, keep_from, window_start=None):
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    T = int(cu[-1])
    pos = np.concatenate([np.arange(s, s + q) for s, q in zip(starts, q_lens)])
    t = lambda a: torch.tensor(np.asarray(a), dtype=torch.int64)   # noqa: E731
    return ForwardBatch(input_ids=t(pos + 1000), positions=t(pos), cu_seqlens=t(cu), start_pos=t(starts),
                        ngram_history=torch.zeros(len(starts), 3, dtype=torch.int64), ring_slots=t(range(len(starts))),
                        block_tables=torch.zeros(len(starts), 1, dtype=torch.int64), logits_indices=t(cu[1:] - 1),
                        token_mask=torch.arange(T) % 2 == 0,
                        window_start=None if window_start is None else t(window_start),
                        yoco_keep_from=t(keep_from))


def test_rows_kept_per_sequence():
    # seq 0: chunk [0, 32) wholly before keep_from 40 -> its last row (placeholder)
    # seq 1: chunk [32, 64) cut at 40;  seq 2: a decode row at 300;  seq 3: whole prompt [0, 180), keep 40
    b = batch([0, 32, 300, 0], [32, 32, 1, 180], [40, 40, 160, 40])
    c = plan_compaction(b)
    sub = c.batch
    assert sub.start_pos.tolist() == [31, 40, 300, 40]
    assert (sub.cu_seqlens[1:] - sub.cu_seqlens[:-1]).tolist() == [1, 24, 1, 140]
    kept = c.kept.tolist()
    assert kept[:2] == [31, 32 + 8] and kept[25] == 64 and kept[26] == 65 + 40 and kept[-1] == 244
    assert sub.positions.tolist() == b.positions[c.kept].tolist()
    assert sub.token_mask.tolist() == b.token_mask[c.kept].tolist()
    # each sequence's last row is still its logits row
    assert sub.logits_indices.tolist() == (sub.cu_seqlens[1:] - 1).tolist()
    # no window key below keep_from, a placeholder sees itself; nothing compressed is written again
    assert sub.window_start.tolist() == [31, 40, 160, 40]
    assert sub.write_from.tolist() == [32, 64, 301, 180]


def test_replay_floor_and_untouched_steps():
    # a replay from 50 (its window floor) kept whole next to a prompt cut at 60: each keeps its floor
    b = batch([50, 0], [100, 200], [30, 60], window_start=[50, 0])
    sub = plan_compaction(b).batch
    assert sub.start_pos.tolist() == [50, 60] and sub.window_start.tolist() == [50, 60]
    assert plan_compaction(batch([100, 7], [10, 1], [90, 0])) is None  # nothing dropped: exact mode's step


def test_boundary_and_checks():
    from deepinfer.checkpoint.generator import hf_config, text_config
    from deepinfer.model.args import ModelArgs
    for preset, B in (("tiny", 6), ("small", 8), ("full-width-ep8", 4)):
        args = ModelArgs.from_hf_config(hf_config(text_config(preset)))
        assert decoder_start(args) == B
        check_yoco(args, 140, 6)
    import json
    from pathlib import Path
    release = ModelArgs.from_hf_config(json.loads((Path(__file__).resolve().parents[2] / "deepinfer" / "configs"
                                                   / "deepseek-v4.1-flash" / "config.json").read_text()))
    assert decoder_start(release) == 20
    check_yoco(release, 140, 6)
