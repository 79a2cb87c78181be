"""Images encoded ahead of scheduling on the rank workers (attention DP), as the one-rank engine does.

A request's images are encoded on the rank that holds it, on that GPU's share of the SMs
(EngineArgs.vision_sm_share, worker/sm_partition.py), beside the steps; the scheduler admits the
request once its rank reports them encoded. Before, a rank's runner encoded them on the step stream
in the step that first read them, and every rank waited for it in that step's collectives.

    engine  RankImageEncoder.submit(rank, req, indices)  each rank's Scheduler.encode_images hook (the
                                                        engine's add_request and a shorter prefix hit /
                                                        a preemption ask through it)
            RankImageEncoder.flush()                    once a step, before scheduling, while any image is
                                                        asked, in flight or held: one ("images", jobs,
                                                        drops) round trip to every rank; the images a rank
                                                        reports done become ON_RANK in the engine's
                                                        ImagePrompt, which makes it ready to schedule; a
                                                        request whose images failed fails alone
    rank    RankImages.handle(jobs, drops)              the rank's ImageEncoder on its SM share; prompts kept
                                                        by ImagePrompt.ahead_key until the engine drops them
                                                        (the request finished); -> images whose pass is done
            ImageEmbeds.add                             takes the rank's encoded prompt by its key

Keys, not request ids, name a held prompt: an id may come back for a new request (with other images)
before the engine has told the rank to drop the finished one.
"""

from __future__ import annotations

import itertools
from functools import partial

ON_RANK = "encoded on its rank"     # an engine-side ImagePrompt.embeds entry: the rank holds the embeddings


class RankImageEncoder:
    """The engine's half: asks each request's rank to encode, hears back which images are done."""

    def __init__(self, executor, scheduler) -> None:
        """executor: MultiprocExecutor (encode_images); scheduler: DataParallelScheduler, whose per-rank
        schedulers get the submit hook."""
        self.executor, self.scheduler = executor, scheduler
        n = len(scheduler.schedulers)
        self._jobs: list[list] = [[] for _ in range(n)]   # rank -> [(key, ImagePrompt, indices)] since the last flush
        self._held: dict[str, tuple[int, object]] = {}    # key -> (rank, Request) whose prompt that rank holds
        self._asked: dict[str, set[int]] = {}             # key -> image indices asked, not yet reported done
        self._keys = itertools.count()
        self.images_done = 0                              # requests' images the ranks reported encoded
        for rank, s in enumerate(scheduler.schedulers):
            s.encode_images = partial(self.submit, rank)

    def submit(self, rank: int, req, indices) -> None:
        """Encode req's images `indices` on `rank` (asked at the next flush)."""
        p = req.image_prompt
        p.encoding = True
        if p.embeds is None:
            p.embeds = [None] * len(p.images)
        todo = [i for i in indices if i not in p.asked]
        p.asked.update(todo)
        if not todo:
            return
        if p.ahead_key is None:
            p.ahead_key = f"{req.request_id}#{next(self._keys)}"
        self._jobs[rank].append((p.ahead_key, p, todo))
        self._held[p.ahead_key] = (rank, req)
        self._asked.setdefault(p.ahead_key, set()).update(todo)

    def flush(self) -> dict[str, str]:
        """-> {req_id: error} of the requests whose images their rank failed to encode."""
        n = len(self._jobs)
        drops: list[list[str]] = [[] for _ in range(n)]
        for key, (rank, req) in list(self._held.items()):
            if req.is_finished:          # finished or aborted, admitted or not: the rank frees its copy
                drops[rank].append(key)
                del self._held[key]
                self._asked.pop(key, None)
                self._jobs[rank] = [j for j in self._jobs[rank] if j[0] != key]   # aborted before it was sent
        if not self._asked and not any(drops) and not any(self._jobs):
            return {}
        jobs, self._jobs = self._jobs, [[] for _ in range(n)]
        failures = {}
        for done, failed in self.executor.encode_images(jobs, drops):
            for key, error in failed.items():
                if key in self._held:
                    failures[self._held.pop(key)[1].request_id] = error
                    self._asked.pop(key, None)
            for key, indices in done:
                if key not in self._held:
                    continue
                p = self._held[key][1].image_prompt
                for i in indices:
                    p.embeds[i] = ON_RANK
                self.images_done += len(indices)
                left = self._asked.get(key, set()) - set(indices)
                if left:
                    self._asked[key] = left
                else:
                    self._asked.pop(key, None)
        return failures


class RankImages:
    """The rank's half: prompts encoded ahead, by key, on the rank's share of the SMs."""

    def __init__(self, embeds, sm_share: float | None) -> None:
        """embeds: the rank runner's ImageEmbeds (its `ahead` is where the runner finds these prompts)."""
        from deepinfer.worker.image_embeds import ImageEncoder
        self.encoder = ImageEncoder(embeds.tower, embeds.batch_invariant, sm_share)
        self.prompts = embeds.ahead                    # key -> ImagePrompt with this rank's embeddings
        self._unreported: dict[str, set[int]] = {}     # key -> indices encoded (or in flight), not yet reported

    def handle(self, jobs: list, drops: list[str]) -> tuple[list[tuple[str, list[int]]], dict[str, str]]:
        """Drop finished requests' prompts, start one pass over the new jobs' images. -> ((key, indices)
        of the images whose pass has finished, each once; {key: error} of the prompts that failed to
        encode, dropped here: their requests fail, the rank goes on)."""
        for key in drops:
            self.prompts.pop(key, None)
            self._unreported.pop(key, None)
        for key, prompt, todo in jobs:
            held = self.prompts.setdefault(key, prompt)
            self.encoder.submit(held, todo, key)
            self._unreported.setdefault(key, set()).update(todo)
        failed = self.encoder.flush()
        for key in failed:
            self.prompts.pop(key, None)
            self._unreported.pop(key, None)
        done = []
        for key, todo in list(self._unreported.items()):
            event = self.prompts[key].event
            if event is None or event.query():
                done.append((key, sorted(todo)))
                del self._unreported[key]
        return done, failed
