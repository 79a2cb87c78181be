"""The engine's device side: what turns a SchedulerOutput into sampled tokens on one rank.

    rank.py            RankRuntime: one rank's model, caches, sampler and ModelRunner
    model_runner.py    ModelRunner: launch (build, forward, sample, resolve on the device) / resolve
                       (one host copy), the async engine's two halves
    input_batch.py     InputBatch: persistent per-request host arrays -> the step's ForwardBatch
    graph_step.py      decode and DSpark verify steps through CUDA graphs (the fast path)
    cuda_graph.py      capture once per padded batch size, replay with the step's buffers
    overlapped_step.py verify steps built on the device from the step still in flight (spec/overlap.py)
    image_embeds.py    image span embeddings, encoded once per request, read by the steps that need them
    sm_partition.py    a share of the GPU's SMs for side work (the image encoder): a green context's stream
    loading.py         the seam to the model package: dtypes, cache sizes, cache allocation
"""
