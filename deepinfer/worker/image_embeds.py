"""Image span embeddings: encoded once per request, batched over requests, read by the steps whose
chunks cover the spans.

ImageEncoder (the engine with one rank in process; on rank workers, parallel/image_ahead.py's RankImages):
encodes AHEAD of scheduling, beside the steps.

    engine.add_request -> submit(prompt, i) the request waits (ImagePrompt.ready_from is False); with
                                            prefix caching only the images whose spans end past the
                                            expected hit's start (the others are never read)
    engine.step        -> flush()           ONE tower pass over every image submitted since the last
                                            step (each distinct image once, by content hash), on its
                                            own CUDA stream; the step's own kernels are not held up,
                                            and with sm_share the tower runs on that share of the SMs
                                            (worker/sm_partition.py) so it cannot crowd the steps out
    scheduler          -> admits the request from its start once the images it reads are encoded
                          (a hit shorter than expected, or a preempted request, submits the rest and waits)

ImageEmbeds (the runner): what each running request's spans hold.

    add(req, prompt, s)  precomputed embeddings (the encoder's, or on a rank worker the copy its RankImages
                         encoded, found by the prompt's ahead_key: the step stream waits on its event), or
                         the images wait for encode_pending() (one pass before the step that first needs
                         them, on the step stream: a prompt no encoder saw);
                         only images whose spans end past s, the request's start (a prefix hit's)
    gather(...)          the step's rows inside spans and their embeddings (ForwardBatch.image_rows,
                         .image_embeds); the scheduler never cuts a span, so a chunk holds whole spans
    remove(req)          finished / preempted: freed (a preempted request keeps its ImagePrompt's
                         embeddings and is not encoded again)
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from deepinfer.kernels.batch_invariant import batch_invariant_mode

logger = logging.getLogger(__name__)


def _key(im) -> str:
    return im.content_hash or str(id(im))


def encode_unique(tower, prompts_images: list[list], batch_invariant: bool) -> tuple[list[list[torch.Tensor]], int]:
    """One tower pass over the distinct images of several requests -> (embeddings per request, images run)."""
    unique: dict[str, object] = {}
    for images in prompts_images:
        for im in images:
            unique.setdefault(_key(im), im)
    with batch_invariant_mode(batch_invariant):
        embeds = dict(zip(unique, tower.encode(list(unique.values()))))
    return [[embeds[_key(im)] for im in images] for images in prompts_images], len(unique)


class ImageEncoder:
    def __init__(self, tower, batch_invariant: bool = False, sm_share: float | None = None) -> None:
        """sm_share (EngineArgs.vision_sm_share): the tower's encodes run on this share of the GPU's SMs
        (a green context's stream); None or 1: on every SM, beside the steps."""
        self.tower = tower
        self.batch_invariant = batch_invariant
        dev = tower.image_start.device
        self.stream, self.num_sms = None, None
        if dev.type == "cuda":
            part = None
            if sm_share is not None and sm_share < 1:
                from .sm_partition import sm_partition_stream
                part = sm_partition_stream(dev, sm_share)
            self.stream = part.stream if part is not None else torch.cuda.Stream(dev)
            self.num_sms = part.num_sms if part is not None else None
        self._pending: list = []                 # ImagePrompts submitted since the last flush
        self.images_done = 0                     # requests' images encoded (one shared by two requests: 2)
        self.num_encoded = 0
        self.num_passes = 0

    def submit(self, prompt, indices=None, req_id: str = "") -> None:
        """Encode prompt's images `indices` (all by default) at the next flush; req_id names the
        request in flush()'s failures."""
        prompt.encoding = True
        if prompt.embeds is None:
            prompt.embeds = [None] * len(prompt.images)
        todo = [i for i in (range(len(prompt.images)) if indices is None else indices) if i not in prompt.asked]
        prompt.asked.update(todo)
        if todo:
            self._pending.append((prompt, todo, req_id))

    def submit_request(self, req, indices=None) -> None:
        """The scheduler's encode_images hook."""
        self.submit(req.image_prompt, indices, req.request_id)

    def flush(self) -> dict[str, str]:
        """One pass over the images submitted since the last flush. -> {req_id: error} of the requests
        whose images could not be encoded: a pass that raises is retried request by request, so one
        request's failure (a bad image, memory) fails that request alone."""
        if not self._pending:
            return {}
        pending, self._pending = self._pending, []
        try:
            self._encode(pending)
            return {}
        except Exception as e:  # noqa: BLE001 - reported per request
            if len(pending) == 1:
                logger.exception("image encoding failed for request %s", pending[0][2])
                return {pending[0][2]: f"{type(e).__name__}: {e}"}
        failed = {}
        for one in pending:
            try:
                self._encode([one])
            except Exception as e:  # noqa: BLE001
                logger.exception("image encoding failed for request %s", one[2])
                failed[one[2]] = f"{type(e).__name__}: {e}"
        return failed

    def _encode(self, pending: list) -> None:
        images = [[p.images[i] for i in todo] for p, todo, _ in pending]
        if self.stream is None:
            embeds, n = encode_unique(self.tower, images, self.batch_invariant)
            event = None
        else:
            self.stream.wait_stream(torch.cuda.current_stream())   # inputs made on the step stream
            with torch.cuda.stream(self.stream):
                embeds, n = encode_unique(self.tower, images, self.batch_invariant)
                event = torch.cuda.Event()
                event.record(self.stream)
        for (p, todo, _), e in zip(pending, embeds):
            for i, x in zip(todo, e):
                p.embeds[i] = x
            self.images_done += len(todo)
            p.event = event          # one stream: the latest event covers the earlier passes too
        self.num_encoded += n
        self.num_passes += 1


class ImageEmbeds:
    def __init__(self, tower, batch_invariant: bool = False) -> None:
        self.tower = tower                      # deepinfer.model.vision.VisionTower
        self.batch_invariant = batch_invariant
        self.spans: dict[str, list[tuple[int, torch.Tensor]]] = {}   # req_id -> [(start, [span_len, dim])]
        # rank workers: prompts this rank encoded ahead, by ImagePrompt.ahead_key (parallel/image_ahead.py)
        self.ahead: dict[str, object] = {}
        self._pending: list[tuple[str, list]] = []
        self.num_encoded = 0                    # images run through the tower (stats, tests)
        self.num_passes = 0                     # tower passes

    def add(self, req_id: str, prompt, start: int = 0) -> None:
        """prompt: the request's ImagePrompt; its embeddings are used when the encoder made them.
        start: the request's first position to run (past a prefix hit): images wholly before it
        are never read, so none is encoded or required for them."""
        prompt = self.ahead.get(prompt.ahead_key, prompt)    # a rank's copy with its embeddings
        if prompt.embeds is None:
            need = prompt.needed(start)
            if need:
                self._pending.append((req_id, [prompt.images[i] for i in need]))
            return
        if prompt.missing(start):       # the scheduler admits only when they are encoded
            raise RuntimeError(f"request {req_id}: images {prompt.missing(start)} from position {start} "
                               "are not encoded")
        if prompt.event is not None:
            stream = torch.cuda.current_stream()
            stream.wait_event(prompt.event)
            for e in prompt.embeds:          # made on the encoder's stream, read on this one
                if e is not None:
                    e.record_stream(stream)
        self.spans[req_id] = [(im.start, e) for im, e in zip(prompt.images, prompt.embeds) if e is not None]

    def remove(self, req_id: str) -> None:
        self.spans.pop(req_id, None)
        self._pending = [(r, ims) for r, ims in self._pending if r != req_id]

    def has_any(self) -> bool:
        return bool(self.spans)

    def encode_pending(self) -> None:
        if not self._pending:
            return
        embeds, n = encode_unique(self.tower, [images for _, images in self._pending], self.batch_invariant)
        self.num_encoded += n
        self.num_passes += 1
        for (req_id, images), e in zip(self._pending, embeds):
            self.spans[req_id] = [(im.start, x) for im, x in zip(images, e)]
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
