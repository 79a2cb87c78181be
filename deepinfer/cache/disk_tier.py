"""The disk tier of the prefix cache, under the host tier (`disk_cache_dir`, `disk_cache_bytes`).

    device pool --evict--> host tier (LRU slots) --evict--> disk tier (one file per block, LRU, bounded)
    hit on h: device, else host (onload slot -> block), else disk (read file -> block)

Same two halves as the host tier: DiskTierIndex (scheduler side: which hashes have a file, LRU,
at most num_blocks files) and DiskBlockStore (runner side: writes and reads the files). The
scheduler decides, the runner copies in decision order (outputs.BlockCopy kinds "spill": host slot
-> file, "disk_onload": file -> device block, "disk_drop": delete), so a host slot is spilled
before the offload that reuses it, and a file is read before anything drops it.

Files live in a fresh folder made under disk_cache_dir per engine, removed at exit: a block's
bytes are this model's layout, never reused by another process. The copies are synchronous file
I/O on the step thread (a block is one to a few hundred KB); an io thread is the next step if a
workload spills often.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections import OrderedDict

import torch


class DiskTierIndex:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._lru: OrderedDict[bytes, None] = OrderedDict()   # hashes with a file, least recently used first
        self.num_evictions = 0

    def __len__(self) -> int:
        return len(self._lru)

    def has(self, block_hash: bytes) -> bool:
        if block_hash in self._lru:
            self._lru.move_to_end(block_hash)
            return True
        return False

    def __contains__(self, block_hash: bytes) -> bool:
        """Held here (a look: the LRU order stays)."""
        return block_hash in self._lru

    def put(self, block_hash: bytes) -> list[bytes] | None:
        """Room for this hash's file: -> the hashes whose files to drop for it (LRU first), or None
        when it is held already or the tier has no room at all."""
        if self.num_blocks == 0 or block_hash in self._lru:
            return None
        dropped = []
        while len(self._lru) >= self.num_blocks:
            h, _ = self._lru.popitem(last=False)
            dropped.append(h)
            self.num_evictions += 1
        self._lru[block_hash] = None
        return dropped


class DiskBlockStore:
    """Block files of one engine: the host tier's slot layout (HostBlockStore), as raw bytes."""

    def __init__(self, caches, host_store, parent_dir: str) -> None:
        self.caches, self.host = caches, host_store
        os.makedirs(parent_dir, exist_ok=True)
        self.dir = tempfile.mkdtemp(prefix="deepinfer-blocks-", dir=parent_dir)
        atexit.register(shutil.rmtree, self.dir, True)
        self.cuda = caches.window_kv[0].device.type == "cuda"

    def _path(self, key: str) -> str:
        return os.path.join(self.dir, key)

    def spill(self, slot: int, key: str) -> None:
        if self.cuda:      # the slot's offload was an asynchronous copy on the step stream
            torch.cuda.current_stream().synchronize()
        with open(self._path(key), "wb") as f:
            for host, _ in self.host._pairs():
                f.write(host[slot].contiguous().view(torch.uint8).numpy().tobytes())

    def onload(self, key: str, block: int) -> None:
        with open(self._path(key), "rb") as f:
            data = f.read()
        off = 0
        for host, dev in self.host._pairs():
            n = host[0].numel() * host.element_size()
            src = torch.frombuffer(bytearray(data[off:off + n]), dtype=torch.uint8)
            src = src.view(host.dtype).view(host.shape[1:])
            dev[block].copy_(src)
            off += n

    def drop(self, key: str) -> None:
        try:
            os.remove(self._path(key))
        except FileNotFoundError:
            pass


def num_disk_blocks(engine_args, model_args) -> int:
    """disk_cache_bytes / one block's bytes; refuses a tier without a host tier, a folder it cannot
    write, or a size over the folder's free space."""
    n = engine_args.disk_cache_bytes
    if not n or not engine_args.enable_prefix_caching:
        return 0
    if not engine_args.host_cache_bytes:
        raise ValueError("disk_cache_bytes needs host_cache_bytes > 0: the disk tier sits under the host tier")
    d = engine_args.disk_cache_dir
    if not d:
        raise ValueError("disk_cache_bytes needs disk_cache_dir (a folder for the block files)")
    try:
        os.makedirs(d, exist_ok=True)
        free = shutil.disk_usage(d).free
    except OSError as e:
        raise ValueError(f"disk_cache_dir {d!r} is not usable: {e}") from None
    if not os.access(d, os.W_OK):
        raise ValueError(f"disk_cache_dir {d!r} is not writable")
    if n > free:
        raise ValueError(f"disk_cache_bytes ({n}) is larger than the free space under disk_cache_dir ({free} bytes)")
    from deepinfer.cache.model_caches import ModelCaches
    per = ModelCaches.bytes_per_block(model_args, engine_args.block_tokens, getattr(torch, engine_args.dtype))
    return n // per
