"""The runner's image span embeddings: encoded once per request, batched over the requests admitted
in a step, read by the steps whose chunks cover the spans.

    add(req, images)     a new (or resumed) request's images wait for the next encode
    encode_pending()     ONE VisionTower pass over every waiting image (each distinct image once,
                         by content hash), before the step that first needs them
    gather(...)          the step's rows inside spans and their embeddings (ForwardBatch.image_rows,
                         .image_embeds); the scheduler never cuts a span, so a chunk holds whole spans
    remove(req)          finished / preempted: embeddings freed

Spans of a request stay held until it finishes: a preempted request is recomputed from scratch
(its images encoded again when it comes back as a new request).
"""

from __future__ import annotations

import numpy as np
import torch

from deepinfer.kernels.batch_invariant import batch_invariant_mode


class ImageEmbeds:
    def __init__(self, tower, batch_invariant: bool = False) -> None:
        self.tower = tower                      # deepinfer.model.vision.VisionTower
        self.batch_invariant = batch_invariant
        self.spans: dict[str, list[tuple[int, torch.Tensor]]] = {}   # req_id -> [(start, [span_len, dim])]
        self._pending: list[tuple[str, list]] = []
        self.num_encoded = 0                    # images run through the tower (stats, tests)
        self.num_passes = 0                     # tower passes

    def add(self, req_id: str, images: list) -> None:
        self._pending.append((req_id, images))

    def remove(self, req_id: str) -> None:
        self.spans.pop(req_id, None)
        self._pending = [(r, ims) for r, ims in self._pending if r != req_id]

    def has_any(self) -> bool:
        return bool(self.spans)

    def encode_pending(self) -> None:
        if not self._pending:
            return
        unique: dict[str, object] = {}
        for _, images in self._pending:
            for im in images:
                unique.setdefault(im.content_hash or str(id(im)), im)
        with batch_invariant_mode(self.batch_invariant):
            embeds = dict(zip(unique, self.tower.encode(list(unique.values()))))
        self.num_encoded += len(unique)
        self.num_passes += 1
        for req_id, images in self._pending:
            self.spans[req_id] = [(im.start, embeds[im.content_hash or str(id(im))]) for im in images]
        self._pending = []

    def gather(self, req_ids: list[str], start: np.ndarray, q_lens: np.ndarray):
        """-> (rows [n] int64, embeds [n, dim]) of the step's tokens inside image spans, or (None, None).
        start / q_lens: each request's first position and token count this step (batch order)."""
        rows, parts, off = [], [], 0
        for req_id, s0, q in zip(req_ids, start.tolist(), q_lens.tolist()):
            for span_start, emb in self.spans.get(req_id, ()):
                lo, hi = max(span_start, s0), min(span_start + emb.shape[0], s0 + q)
                if lo < hi:
                    rows.append(np.arange(off + lo - s0, off + hi - s0))
                    parts.append(emb[lo - span_start:hi - span_start])
            off += q
        if not rows:
            return None, None
        dev = parts[0].device
        return torch.from_numpy(np.concatenate(rows)).to(dev), torch.cat(parts)
