"""The engine's caches and the KV cache system on top of them.

    model_caches.py      the cache tensors the model reads and writes (window rings, compressor carry,
                         paged compressed KV and index keys), addressed by absolute position
    block_pool.py        paged blocks: free list, reference counts, hashes of cached blocks, LRU of idle ones
    kv_cache_manager.py  per-request ownership (ring slot + block table); prefix hits by reference;
                         the host and disk tiers' copy decisions
    block_hash.py        content addresses of full blocks: a hash chain over tokens (+ cache_salt, image hook)
    image_keys.py        what the hash chain reads for image-span positions: the image's content and offset
    snapshot_index.py    window snapshots, scheduler side: which ended sequence's window state is where (LRU, TTL)
    snapshot_store.py    window snapshots, runner side: the tensors and the copies in and out
    host_tier.py         the host-memory tier of cached blocks (index + pinned store), and why not LMCache/Mooncake
    disk_tier.py         the disk tier under it (index + block files), bounded by disk_cache_bytes

The scheduler's use of them is sched/prefix_admission.py; the runner's is worker/model_runner.py
(copies) and model/step_metadata.py (bounded replay's window and write floors).
"""
