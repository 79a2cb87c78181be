"""Multi-GPU engine: attention data parallelism (DP) + MoE expert parallelism (EP) at TP 1.

One engine front end (scheduler, request table, outputs) drives N rank workers, one per GPU (or N
CPU processes with gloo: the test mode). Every step the driver sends each rank its own plan; all
ranks run one forward in lockstep (a rank with nothing to do runs an idle step, so every MoE
layer's collectives line up) and only the sampled tokens come back.

    state.py         ParallelState: rank, world size, process group, device (passed to the model)
    ep_comm.py       dispatch(x, topk_ids, topk_weights) -> (LocalTokens, handle); combine(y, handle):
                     local, all-gather / reduce-scatter and all-to-all-v backends
    placement.py     ExpertPlacement: per-layer physical -> logical expert maps, which slots a
                     rank holds, the replica a pair goes to, static placement files
    eplb/            DeepSeek's expert-parallel load balancer: the policy (hierarchical / global,
                     and the per-step-peak variant), load recorder, weight moves between ranks
    dp_scheduler.py  DataParallelScheduler: one Scheduler + KV cache per rank, least-loaded placement,
                     and the step's balanced-CP prefill (cache blocks borrowed on the other ranks)
    cp.py            balanced context parallelism: a long prompt's prefill split over every rank in
                     mirrored chunks (equal causal work), the compressor inputs and window latents
                     all-gathered per layer; the owner rank keeps the caches and decodes
    executor.py      MultiprocExecutor: spawns the rank workers, sends plans, gathers results,
                     notices a dead worker (its requests fail, nothing is left running)
    worker.py        the rank worker process: pins its GPU, joins the group, loads its shard, loops
    image_ahead.py   images encoded ahead of scheduling on the rank that holds the request, on its
                     share of the SMs; the engine admits the request once its rank reports them done
    lockstep.py      CUDA-graph decode across ranks: every rank replays the same captured size in a
                     step (fewer requests padded, none: an all-padding replay) or all run eagerly,
                     agreed by one host all-reduce
    planner.py       memory planner (deepinfer-plan): per-rank weight bytes, KV capacity, fits or not

Attention stays data parallel: one latent KV head, so tensor parallelism would duplicate the cache
(../shared/docs/PARALLEL.md). The shared expert, attention, Engram, the head and the DSpark draft
blocks are replicated; only the backbone's routed experts are split over ranks.
"""
