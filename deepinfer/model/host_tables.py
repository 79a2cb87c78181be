"""Engram tables in host memory (EngineArgs.engram_placement="host").

The release's two Engram tables are 202 GB of FP8 rows (384M rows of 256 bytes each, plus a scale byte per 32),
more than the rest of the model. A step reads little of them: 24 rows a token a layer (~6 KB), so the GPU reads
the rows a step needs straight from pinned host memory over PCIe / C2C (zero-copy) inside the step; CUDA graphs
included, nothing is staged ahead, the hash ids never leave the GPU.

    HostEngramTable   EngramTable's interface over host bytes: weight [R, D] e4m3 and scale [R, D/32] E8M0 are
                      plain attributes (not buffers: Module.to() leaves them in host memory); on CUDA the lookup
                      runs the same kernel on a CUDA view of those bytes (registered, mapped host pages)
    TableShare        one copy per node for the rank workers: the first rank writes a table into a /dev/shm
                      file, the others map it after a barrier, the first unlinks it after a second barrier
                      (the executor removes what a crash left behind, by its prefix)
    host_bytes()      the allocation: anonymous memory for one process, TableShare's file for ranks
    cuda_view()       a CUDA tensor over registered host memory, or None where CUDA cannot map it: the lookup
                      then gathers on the CPU and copies the rows over (said once in the log)
"""

from __future__ import annotations

import glob
import logging
import os
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from .engram import EngramTable

log = logging.getLogger("deepinfer.model.host_tables")

SHM_DIR = "/dev/shm"
FILL_ROWS = 1 << 22           # rows read from the checkpoint at a time (1 GiB of a 256-byte table)
_HOST_REGISTER_PORTABLE, _HOST_REGISTER_MAPPED = 1, 2


class HostMemoryError(RuntimeError):
    """Host memory for the tables cannot be had (a /dev/shm too small for them, a failed registration)."""


@dataclass
class TableShare:
    """The rank workers' shared copy: `prefix` names the files (the executor's, removed at its stop)."""
    prefix: str
    rank: int
    group: Any = None             # torch.distributed group every rank of the node is in

    def path(self, key: str) -> str:
        return os.path.join(SHM_DIR, f"{self.prefix}-{key}")

    def barrier(self) -> None:
        import torch.distributed as dist
        dist.barrier(group=self.group)


def remove_leftovers(prefix: str) -> None:
    """The files of `prefix` a crashed load left (the executor's stop)."""
    for path in glob.glob(os.path.join(SHM_DIR, f"{glob.escape(prefix)}-*")):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _shared_file(path: str, nbytes: int) -> torch.Tensor:
    """A /dev/shm file of nbytes, its space reserved up front: a tmpfs that runs out while the table is written
    would kill the process with SIGBUS; posix_fallocate fails cleanly instead."""
    free = os.statvfs(SHM_DIR)
    if free.f_bavail * free.f_frsize < nbytes:
        raise HostMemoryError(
            f"engram_placement='host': a table needs {nbytes / 2**30:.1f} GiB in {SHM_DIR}, which has "
            f"{free.f_bavail * free.f_frsize / 2**30:.1f} GiB free (containers: raise --shm-size)")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        os.close(fd)
        os.unlink(path)
        raise HostMemoryError(f"engram_placement='host': cannot reserve {nbytes / 2**30:.1f} GiB in {path}: {e}") \
            from None
    os.close(fd)
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)


def available_memory() -> int:
    """Bytes the kernel says a new allocation can have without swapping (/proc/meminfo MemAvailable)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 1 << 62


def _check_memory(nbytes: int) -> None:
    """Refuse a table the host's memory cannot hold before writing it: an overcommitted allocation succeeds and
    the OOM killer ends the process while the rows are written."""
    have = available_memory()
    if have < nbytes:
        raise HostMemoryError(f"engram_placement='host': a table needs {nbytes / 2**30:.1f} GiB of host memory, "
                              f"{have / 2**30:.1f} GiB is available")


def host_bytes(nbytes: int, fill: Callable[[torch.Tensor], None], share: TableShare | None, key: str) -> torch.Tensor:
    """nbytes of host memory holding what fill writes: anonymous for one process; with a share, rank 0 writes
    the file and every rank maps it (the others never read the checkpoint's rows)."""
    if share is None or share.rank == 0:
        _check_memory(nbytes)
    if share is None:
        out = torch.empty(nbytes, dtype=torch.uint8)
        fill(out)
        return out
    path = share.path(key)
    if share.rank == 0:
        out = _shared_file(path, nbytes)
        fill(out)
    share.barrier()                              # written
    if share.rank != 0:
        if os.path.getsize(path) != nbytes:
            raise HostMemoryError(f"{path}: {os.path.getsize(path)} bytes, expected {nbytes}")
        out = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
    share.barrier()                              # mapped by every rank: the name can go
    if share.rank == 0:
        os.unlink(path)
    return out


def host_file_of(t: torch.Tensor) -> str:
    """The file behind the mapping that holds t's bytes ("" for anonymous memory): /proc/self/maps. A rank's
    shared table shows the unlinked /dev/shm file every rank of the node maps."""
    addr = t.data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= addr < hi:
                return fields[5].strip() if len(fields) > 5 else ""
    return ""


def _register(t: torch.Tensor) -> bool:
    """Page-lock and map t's bytes for every device (cudaHostRegister, portable | mapped)."""
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(),
                                               _HOST_REGISTER_PORTABLE | _HOST_REGISTER_MAPPED)
    return int(err) == 0


def _unregister(ptr: int) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:       # interpreter shutdown: CUDA may be gone already
        pass


class _CudaArray:
    """__cuda_array_interface__ over a device-visible address (registered host memory: with unified
    addressing the host pointer is the device pointer)."""

    def __init__(self, t: torch.Tensor) -> None:
        typestr = {torch.uint8: "|u1"}[t.dtype]
        self.__cuda_array_interface__ = {"shape": tuple(t.shape), "typestr": typestr, "data": (t.data_ptr(), False),
                                         "strides": None, "version": 3}


def cuda_view(t: torch.Tensor, device: torch.device) -> torch.Tensor | None:
    """A CUDA tensor aliasing t's registered host bytes, or None where CUDA does not map them."""
    try:
        view = torch.as_tensor(_CudaArray(t), device=device)
    except (RuntimeError, TypeError, ValueError) as e:
        log.warning("Engram tables in host memory: CUDA cannot map them (%s); lookups gather on the CPU", e)
        return None
    return view if view.data_ptr() == t.data_ptr() else None


class HostEngramTable(EngramTable):
    """An Engram table whose rows stay in host memory; lookups read them from there (module docstring)."""

    sharded = False
    host = True

    def __init__(self, rows: int, dim: int, share: TableShare | None = None, key: str = "table"):
        nn.Module.__init__(self)          # no buffers: the rows are not the device's
        self.row_range, self.dim, self.share, self.key = (0, rows), dim, share, key
        self.weight: torch.Tensor | None = None
        self.scale: torch.Tensor | None = None
        self._views: tuple[torch.Tensor, torch.Tensor] | None = None
        self._declined = False

    def fill(self, read_rows: Callable[[int, int], torch.Tensor], read_scale_rows: Callable[[int, int], torch.Tensor],
             device: torch.device | str) -> None:
        """Rows and scales from read_*(lo, hi) into host memory, FILL_ROWS at a time (a chunk on the reader's
        device at most); on a CUDA device, registered and viewed for the lookup kernel."""
        R, D = self.row_range[1], self.dim
        spans = [(lo, min(R, lo + FILL_ROWS)) for lo in range(0, R, FILL_ROWS)]

        def rows_into(read, width):
            def fill(out: torch.Tensor) -> None:
                dst = out.view(R, width)
                for lo, hi in spans:
                    dst[lo:hi].copy_(read(lo, hi).view(torch.uint8).reshape(hi - lo, width))
            return fill

        w = host_bytes(R * D, rows_into(read_rows, D), self.share, f"{self.key}.weight")
        s = host_bytes(R * (D // 32), rows_into(read_scale_rows, D // 32), self.share, f"{self.key}.scale")
        self.weight, self.scale = w.view(R, D).view(torch.float8_e4m3fn), s.view(R, D // 32)
        device = torch.device(device)
        if device.type == "cuda":
            self._map_for(device, w, s)

    def _map_for(self, device: torch.device, *tensors: torch.Tensor) -> None:
        views = []
        for t in tensors:
            if not _register(t):
                log.warning("Engram tables in host memory: cudaHostRegister failed; lookups gather on the CPU")
                return
            weakref.finalize(self, _unregister, t.data_ptr())
            views.append(cuda_view(t, device))
        if all(v is not None for v in views):
            w, s = views
            R, D = self.row_range[1], self.dim
            self._views = (w.view(R, D).view(torch.float8_e4m3fn), s.view(R, D // 32))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        from . import ops
        if not ids.is_cuda:
            return ops.engram_rows(self.weight, self.scale, ids)
        if self._views is not None:
            return ops.engram_rows(*self._views, ids)
        if not self._declined:
            self._declined = True
            log.warning("Engram table %s: no CUDA view of its host rows; gathering on the CPU (a sync a lookup)",
                        self.key)
        return ops.engram_rows(self.weight, self.scale, ids.cpu()).to(ids.device)


def install_host_tables(model, parallel=None) -> None:
    """Every Engram layer's table as a HostEngramTable (before the load fills it); shared by the node's ranks
    where the executor named their files (ParallelState.host_tables)."""
    share = None
    if parallel is not None and parallel.is_parallel:
        if parallel.host_tables:
            share = TableShare(parallel.host_tables, parallel.rank, parallel.group)
        else:
            log.warning("Engram tables in host memory: no shared name from the executor; each rank keeps a copy")
    for layer in model.layers:
        eg = getattr(layer, "engram", None)
        if eg is None:
            continue
        rows, dim = eg.embed.row_range[1] - eg.embed.row_range[0], model.args.engram_head_dim
        if eg.embed.sharded:
            raise ValueError("engram_placement='host' keeps whole tables: the ranks must not split them too")
        eg.embed = HostEngramTable(rows, dim, share, key=f"layer{layer.layer_id}")
