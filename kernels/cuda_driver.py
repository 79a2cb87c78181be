"""CUDA C++ kernels without a build system: compile a .cu to a cubin with nvcc (once per source hash,
cached under ~/.cache/deepinfer/cubin or DEEPINFER_CUBIN_CACHE), load it with the CUDA driver API through ctypes (libcuda.so.1),
build TMA descriptors (cuTensorMapEncodeTiled) and launch on torch's current stream, so a launch is
captured by a CUDA graph like any torch op.

    compile_cubin(src, arch)        -> (cubin path, ptxas log)   nvcc -gencode ...<arch> -cubin -O3 -std=c++17
    kernel(src, name, smem)         -> Kernel for torch's current device (module loaded once per device)
    tensor_map_2d(t, box, swizzle)  -> TensorMap of a 2-D row-major uint8-sized tensor (e4m3)
    Kernel.launch(grid, block, smem, args)   grid x, (x, y) or (x, y, z); args: TensorMap, torch tensors (pointers),
                                             ints (int32)
"""

from __future__ import annotations

import collections
import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading

import torch

CACHE_DIR = os.environ.get("DEEPINFER_CUBIN_CACHE") or os.path.join(
    os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "deepinfer", "cubin")
NVCC_FLAGS = ("-cubin", "-O3", "-std=c++17", "-Xptxas", "-v")

# cuda.h enums (CUDA 12 / 13)
CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
CU_TENSOR_MAP_DATA_TYPE_UINT8 = 0
CU_TENSOR_MAP_DATA_TYPE_FLOAT32 = 7
CU_TENSOR_MAP_INTERLEAVE_NONE = 0
CU_TENSOR_MAP_SWIZZLE = {0: 0, 32: 1, 64: 2, 128: 3}
CU_TENSOR_MAP_L2_PROMOTION_L2_256B = 3
CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE = 0      # out-of-bounds elements read as zeros

_lock = threading.Lock()


class NvccMissing(RuntimeError):
    pass


@functools.lru_cache(maxsize=None)
def find_nvcc() -> str | None:
    """nvcc from CUDA_HOME, then PATH, then /usr/local/cuda."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    for cand in ([os.path.join(home, "bin", "nvcc")] if home else []) + [shutil.which("nvcc") or "",
                                                                          "/usr/local/cuda/bin/nvcc"]:
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


def _gencode(arch: str) -> str:
    """sm_90a -> -gencode=arch=compute_90a,code=sm_90a: the explicit form (a newer nvcc's -arch=sm_90a
    shorthand also runs a plain sm_90 pass that rejects wgmma / setmaxnreg; HOPPER.md)."""
    assert arch.startswith("sm_"), arch
    return f"-gencode=arch=compute_{arch[3:]},code={arch}"


def _headers_text(folder: str) -> bytes:
    """The .cuh headers beside a source (what its #include "..." lines can reach), in name order: part of
    the cache key, so editing a shared header recompiles every source."""
    out = b""
    for name in sorted(os.listdir(folder)):
        if name.endswith(".cuh"):
            with open(os.path.join(folder, name), "rb") as f:
                out += name.encode() + b"\0" + f.read()
    return out


def compile_cubin(src: str, arch: str = "sm_90a") -> tuple[str, str]:
    """(cubin path, ptxas -v log) of source file src for arch; compiled once per (source, arch, flags,
    nvcc) hash. The log of a cached cubin is the one its compilation wrote."""
    nvcc = find_nvcc()
    if nvcc is None:
        raise NvccMissing("the CUDA kernels need nvcc (CUDA 12.3+; set CUDA_HOME or put nvcc on PATH)")
    with open(src, "rb") as f:
        text = f.read()
    text += _headers_text(os.path.dirname(os.path.abspath(src)))
    key = hashlib.sha256(text + repr((arch, NVCC_FLAGS, os.path.realpath(nvcc))).encode()).hexdigest()[:20]
    cache = CACHE_DIR
    try:
        os.makedirs(cache, exist_ok=True)
    except OSError:                              # a read-only home: the temp folder
        cache = os.path.join(tempfile.gettempdir(), "deepinfer-cubin")
        os.makedirs(cache, exist_ok=True)
    stem = os.path.join(cache, f"{os.path.splitext(os.path.basename(src))[0]}-{arch}-{key}")
    cubin, log_path = stem + ".cubin", stem + ".log"
    with _lock:
        if os.path.exists(cubin) and os.path.exists(log_path):
            with open(log_path) as f:
                return cubin, f.read()
        fd, tmp = tempfile.mkstemp(suffix=".cubin", dir=cache)
        os.close(fd)
        r = subprocess.run([nvcc, _gencode(arch), *NVCC_FLAGS, "-o", tmp, src], capture_output=True, text=True)
        if r.returncode != 0:
            os.unlink(tmp)
            raise RuntimeError(f"nvcc failed on {src}:\n{r.stderr[-4000:]}")
        with open(log_path, "w") as f:
            f.write(r.stderr)
        os.replace(tmp, cubin)                   # atomic: a concurrent reader sees all or nothing
        return cubin, r.stderr


@functools.lru_cache(maxsize=None)
def _libcuda():
    lib = ctypes.CDLL("libcuda.so.1")
    P, U, I = ctypes.c_void_p, ctypes.c_uint, ctypes.c_int
    sigs = {
        "cuInit": [U],
        "cuDeviceGet": [ctypes.POINTER(I), I],
        "cuDevicePrimaryCtxRetain": [ctypes.POINTER(P), I],
        "cuCtxGetCurrent": [ctypes.POINTER(P)],
        "cuCtxSetCurrent": [P],
        "cuModuleLoadData": [ctypes.POINTER(P), P],
        "cuModuleGetFunction": [ctypes.POINTER(P), P, ctypes.c_char_p],
        "cuFuncSetAttribute": [P, I, I],
        "cuTensorMapEncodeTiled": [P, I, U, P, ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64),
                                   ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32), I, I, I, I],
        "cuLaunchKernel": [P, U, U, U, U, U, U, U, P, ctypes.POINTER(P), ctypes.POINTER(P)],
        "cuGetErrorName": [I, ctypes.POINTER(ctypes.c_char_p)],
    }
    for name, args in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, I
    _check(lib, lib.cuInit(0), "cuInit")
    return lib


def _check(lib, res: int, what: str) -> None:
    if res != 0:
        name = ctypes.c_char_p()
        lib.cuGetErrorName(res, ctypes.byref(name))
        raise RuntimeError(f"CUDA driver: {what} failed: {(name.value or b'?').decode()} ({res})")


def _make_current(device: int) -> None:
    """torch's primary context of `device` current on this thread (torch makes it current lazily)."""
    lib = _libcuda()
    ctx = _primary_ctx(device)
    cur = ctypes.c_void_p()
    _check(lib, lib.cuCtxGetCurrent(ctypes.byref(cur)), "cuCtxGetCurrent")
    if cur.value != ctx.value:
        _check(lib, lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")


@functools.lru_cache(maxsize=None)
def _primary_ctx(device: int) -> ctypes.c_void_p:
    lib = _libcuda()
    torch.cuda.init()
    dev = ctypes.c_int()
    _check(lib, lib.cuDeviceGet(ctypes.byref(dev), device), "cuDeviceGet")
    ctx = ctypes.c_void_p()
    _check(lib, lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev.value), "cuDevicePrimaryCtxRetain")
    return ctx


class TensorMap:
    """A CUtensorMap (128 bytes, 64-byte aligned), passed by value as a __grid_constant__ parameter."""

    def __init__(self):
        self._buf = ctypes.create_string_buffer(128 + 64)
        self.addr = (ctypes.addressof(self._buf) + 63) & ~63


# descriptors by everything cuTensorMapEncodeTiled reads (address, dims, stride, box, swizzle): a hit is
# the descriptor the call would build, so the memo can never go stale; it saves the ctypes encode (~4 a
# MoE layer in a prefill chunk, whose host time is what bounds it)
_MAPS: "collections.OrderedDict[tuple, TensorMap]" = collections.OrderedDict()
MAP_CACHE = 512
_maps_lock = threading.Lock()


def tensor_map_2d(t: torch.Tensor, box_inner: int, box_outer: int, swizzle: int = 128, rows: int | None = None) -> TensorMap:
    """TMA descriptor of a row-major 2-D tensor of 1-byte elements (or float32) [rows, cols] with a
    (box_outer rows x box_inner cols) box; rows and columns past the tensor read as zeros. The row stride must
    be a multiple of 16 bytes and the base 16-byte aligned (cuTensorMapEncodeTiled's rules). Memoized (_MAPS)."""
    assert t.dim() == 2 and (t.element_size() == 1 or t.dtype == torch.float32) and t.stride(1) == 1, \
        (t.shape, t.stride(), t.dtype)
    key = (t.data_ptr(), t.shape[1], rows if rows is not None else t.shape[0], t.stride(0), box_inner, box_outer,
           swizzle, t.element_size())
    with _maps_lock:
        m = _MAPS.get(key)
        if m is not None:
            _MAPS.move_to_end(key)
            return m
    m = _encode_map_2d(t, box_inner, box_outer, swizzle, rows)
    with _maps_lock:
        _MAPS[key] = m
        if len(_MAPS) > MAP_CACHE:
            _MAPS.popitem(last=False)
    return m


def _encode_map_2d(t: torch.Tensor, box_inner: int, box_outer: int, swizzle: int, rows: int | None) -> TensorMap:
    lib = _libcuda()
    m = TensorMap()
    dims = (ctypes.c_uint64 * 2)(t.shape[1], rows if rows is not None else t.shape[0])
    strides = (ctypes.c_uint64 * 1)(t.stride(0) * t.element_size())     # bytes
    box = (ctypes.c_uint32 * 2)(box_inner, box_outer)
    elem = (ctypes.c_uint32 * 2)(1, 1)
    dtype = CU_TENSOR_MAP_DATA_TYPE_FLOAT32 if t.dtype == torch.float32 else CU_TENSOR_MAP_DATA_TYPE_UINT8
    _check(lib, lib.cuTensorMapEncodeTiled(ctypes.c_void_p(m.addr), dtype, 2,
                                           ctypes.c_void_p(t.data_ptr()), dims, strides, box, elem,
                                           CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE[swizzle],
                                           CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE),
           f"cuTensorMapEncodeTiled({tuple(t.shape)}, stride {t.stride(0)}, box {box_outer}x{box_inner})")
    return m


CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4
# programmatic dependent launch: the kernel may start before the one ahead of it in the stream ends (its
# griddepcontrol.wait holds what reads that kernel's output); in a captured graph, a programmatic edge
CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class _LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute: the id, padding to 8 bytes, a 64-byte value union (clusterDim: 3 x uint32)."""
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_uint32 * 16)]


class _LaunchConfig(ctypes.Structure):
    """CUlaunchConfig (cuLaunchKernelEx)."""
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


def _launch_ex(lib, func, grid: tuple[int, int, int], block: int, smem: int, stream, params, cluster: int = 1,
               pdl: bool = False) -> int:
    """cuLaunchKernelEx with a (cluster, 1, 1) cluster-dimension attribute (cluster > 1) and / or programmatic
    stream serialization (pdl); its CUresult."""
    fn = lib.cuLaunchKernelEx
    fn.argtypes, fn.restype = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                               ctypes.POINTER(ctypes.c_void_p)], ctypes.c_int
    attrs = (_LaunchAttribute * 2)()
    n = 0
    if cluster > 1:
        attrs[n].id = CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        attrs[n].value[0], attrs[n].value[1], attrs[n].value[2] = cluster, 1, 1
        n += 1
    if pdl:
        attrs[n].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attrs[n].value[0] = 1
        n += 1
    cfg = _LaunchConfig(grid[0], grid[1], grid[2], block, 1, 1, smem, stream,
                        ctypes.cast(attrs, ctypes.POINTER(_LaunchAttribute)), n)
    return fn(ctypes.byref(cfg), func, params, None)


class Kernel:
    """One __global__ function of a loaded cubin (on one device)."""

    def __init__(self, func: ctypes.c_void_p, device: int):
        self.func, self.device = func, device

    def launch(self, grid: int | tuple[int, ...], block: int, smem: int, args, cluster: int = 1,
               pdl: bool = False) -> None:
        """Launch on torch's current stream of the kernel's device. grid: x, (x, y) or (x, y, z). args in the kernel's
        order: TensorMap (by value), torch.Tensor or None (a pointer), int (int32). cluster > 1: a kernel
        compiled with __cluster_dims__(cluster, 1, 1) (cuLaunchKernel launches its clusters; where a driver
        refuses that, cuLaunchKernelEx with the cluster-dimension attribute). pdl: a programmatic dependent
        launch (a kernel whose griddepcontrol.wait guards every read of earlier kernels' outputs and every
        global write)."""
        dims = (grid,) if isinstance(grid, int) else tuple(grid)
        gx, gy, gz = dims + (1,) * (3 - len(dims))
        lib = _libcuda()
        _make_current(self.device)
        keep, ptrs = [], []
        for a in args:
            if isinstance(a, TensorMap):
                ptrs.append(a.addr)
                continue
            if a is None or isinstance(a, torch.Tensor):
                v = ctypes.c_void_p(a.data_ptr() if a is not None else 0)
            elif isinstance(a, int):
                v = ctypes.c_int32(a)
            else:
                raise TypeError(f"kernel argument of type {type(a).__name__}")
            keep.append(v)
            ptrs.append(ctypes.addressof(v))
        params = (ctypes.c_void_p * len(ptrs))(*ptrs)
        stream = torch.cuda.current_stream(self.device).cuda_stream
        if pdl:
            _check(lib, _launch_ex(lib, self.func, (gx, gy, gz), block, smem, stream, params, cluster, pdl=True),
                   "cuLaunchKernelEx (programmatic dependent launch)")
            return
        res = lib.cuLaunchKernel(self.func, gx, gy, gz, block, 1, 1, smem, ctypes.c_void_p(stream), params, None)
        if res != 0 and cluster > 1:
            assert gz == 1, "cluster launches are 2-D"
            res_ex = _launch_ex(lib, self.func, (gx, gy, 1), block, smem, stream, params, cluster)
            _check(lib, res_ex, f"cuLaunchKernelEx (cluster {cluster}, after cuLaunchKernel's error {res})")
            return
        _check(lib, res, "cuLaunchKernel")


@functools.lru_cache(maxsize=None)
def _module(cubin: str, device: int) -> ctypes.c_void_p:
    lib = _libcuda()
    _make_current(device)
    with open(cubin, "rb") as f:
        data = f.read()
    mod = ctypes.c_void_p()
    buf = ctypes.create_string_buffer(data, len(data))
    _check(lib, lib.cuModuleLoadData(ctypes.byref(mod), buf), f"cuModuleLoadData({cubin})")
    return mod


@functools.lru_cache(maxsize=None)
def _kernel(src: str, name: str, smem: int, device: int, arch: str) -> Kernel:
    lib = _libcuda()
    mod = _module(compile_cubin(src, arch)[0], device)
    func = ctypes.c_void_p()
    _check(lib, lib.cuModuleGetFunction(ctypes.byref(func), mod, name.encode()), f"cuModuleGetFunction({name})")
    _check(lib, lib.cuFuncSetAttribute(func, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem),
           f"cuFuncSetAttribute({name}, max dynamic shared memory {smem})")
    return Kernel(func, device)


def kernel(src: str, name: str, smem: int, device: int | None = None, arch: str = "sm_90a") -> Kernel:
    """__global__ function `name` of source file src, compiled for arch, loaded on device (torch's
    current one by default) with `smem` bytes of dynamic shared memory allowed."""
    if device is None:
        device = torch.cuda.current_device()
    return _kernel(os.path.abspath(src), name, smem, device, arch)
