"""The engine's caches and the KV cache system on top of them.

    model_caches.py      the cache tensors the model reads and writes (window rings, compressor carry,
                         paged compressed KV and index keys), addressed by absolute position
    block_pool.py        paged blocks: free list, reference counts, hashes of cached blocks, LRU of idle ones
    kv_cache_manager.py  per-request ownership (ring slot + block table); prefix hits by reference;
                         the host tier's offload / onload decisions
    block_hash.py        content addresses of full blocks: a hash chain over tokens (+ cache_salt, image hook)
    snapshot_index.py    window snapshots, scheduler side: which ended sequence's window state is where (LRU, TTL)
    snapshot_store.py    window snapshots, runner side: the tensors and the copies in and out
    host_tier.py         the host-memory tier of cached blocks (index + pinned store), and why not LMCache/Mooncake

The scheduler's use of them is sched/prefix_admission.py; the runner's is worker/model_runner.py
(copies) and model/step_metadata.py (bounded replay's window and write floors).
"""
