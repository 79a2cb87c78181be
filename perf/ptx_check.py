"""Offline SM90 code check of the Triton GEMMs (no GPU): compile each kernel variant for sm_90a exactly as
its launcher would call it on the H200, and count what the K loop turned into.

    python perf/ptx_check.py                          # every case x every W8A16 variant
    python perf/ptx_check.py --cases moe_w13_m8 --variants v1,v2 --ops --dump /tmp/ir   (opcode mix, ttgir/ptx)
    python perf/ptx_check.py --cfg num_warps=8,NUM_STAGES=3     # a launch-config override on every case
    python perf/ptx_check.py --matrix                 # compile every constexpr combination (small shapes)
    python perf/ptx_check.py --list

How: the entry points (w8a16_gemm, w8a16_grouped_gemm_masked, fp8_gemm) run on meta tensors with the
kernels replaced by recorders, so the tile config, split-K and the argument values are the ones the
real launch picks; each recorded launch is specialized as Triton's JIT does it (native_specialize_impl:
16-byte-aligned pointers and ints divisible by 16 get tt.divisibility=16, ints equal to 1 become
constants) and compiled with triton.compile for GPUTarget("cuda", 90).

The specialization matters: compiled without it (a bare ASTSource signature, as in the first probe of
the W8A16 kernel) the loads look unaligned, every load is "too small for pipelining" and the PTX has
no cp.async at all; compiled as launched, v1's weight and activation tiles ARE multi-buffered cp.async
copies and only its E8M0 scale bytes stay plain loads inside the loop.

Columns (PTX/SASS counts are static instruction counts, not executed ones):
    sass          SASS instructions in the K loop (cuobjdump -sass of the cubin; --ops prints the opcode
                  mix: F2F/F2FP are the 16/clk/SM conversion pipe, HGMMA/QGMMA the wgmmas)
    loop          PTX instructions in the K loop's steady-state body (the backward-branch region with the
                  most MMAs)
    cp.async      cp.async.{ca,cg}.shared.global in the PTX (Ampere-style async copies)
    bulk          cp.async.bulk* (TMA) instructions
    wgmma / mma   wgmma.mma_async / mma.sync instructions
    ld.global     plain global loads (not copied asynchronously); ldg.loop: those inside the K loop, each
                  a full memory latency the loop waits for every step
    bufs          leading dims of the multi-buffered shared allocations the pipeliner made (ttgir)
    wait          the largest `pendings` of warp_group_dot_wait (> 0: wgmmas left in flight)
    smem          shared memory bytes (Triton's metadata)
    regs / spill  ptxas -v of the PTX: registers per thread, spill store bytes

Triton on the H200 is 3.6.0: to check with that version here, install it beside the venv's and put it
first on the path (`pip install --no-deps --target /tmp/tri36 triton==3.6.0; PYTHONPATH=/tmp/tri36 ...`).
"""

from __future__ import annotations

import argparse
import inspect
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from deepinfer.kernels import triton_gemm as tg  # noqa: E402

META = torch.device("meta")
KERNEL_NAMES = [n for n in dir(tg) if n.endswith("_kernel") and isinstance(getattr(tg, n), triton.runtime.JITFunction)]


# ---------------------------------------------------------------------------------------------- cases
def _w(n, k, rows=32, e8m0=True, groups=None):
    shape = (n, k) if groups is None else (groups, n, k)
    sshape = (n // rows, k // 32) if groups is None else (groups, n // rows, k // 32)
    w = torch.empty(shape, dtype=torch.float8_e4m3fn, device=META)
    s = torch.empty(sshape, dtype=torch.uint8 if e8m0 else torch.float32, device=META)
    return w, s


def _linear(m, n, k, rows=32, e8m0=True, bi=False):
    def call(cfg):
        w, s = _w(n, k, rows, e8m0)
        x = torch.empty(m, k, dtype=torch.bfloat16, device=META)
        tg.w8a16_gemm(x, w, s, batch_invariant=bi, cfg_override=cfg)
    return call


def _moe(g, em, n, k, rows=1, e8m0=True, mmax=128):
    def call(cfg):
        w, s = _w(n, k, rows, e8m0, groups=g)
        x = torch.empty(g, mmax, k, dtype=torch.bfloat16, device=META)
        mm = torch.empty(g, dtype=torch.int32, device=META)
        tg.w8a16_grouped_gemm_masked(x, w, s, mm, em, cfg_override=cfg)
    return call


def _moe_rows(g, em, n, k, mmax=128):
    def call(cfg):
        w = torch.empty(g, n, k, dtype=torch.float8_e4m3fn, device=META)
        s = torch.empty(g, n, 1, dtype=torch.float32, device=META)
        x = torch.empty(g, mmax, k, dtype=torch.bfloat16, device=META)
        mm = torch.empty(g, dtype=torch.int32, device=META)
        tg.w8a16_grouped_gemm_masked(x, w, s, mm, em, cfg_override=cfg)
    return call


def _moe_fp4(g, em, n, k, mmax=128):
    """The W4A16 masked MoE (packed MXFP4 experts, E8M0 per (row, 32))."""
    def call(cfg):
        w = torch.empty(g, n, k // 2, dtype=torch.uint8, device=META)
        s = torch.empty(g, n, k // 32, dtype=torch.uint8, device=META)
        x = torch.empty(g, mmax, k, dtype=torch.bfloat16, device=META)
        mm = torch.empty(g, dtype=torch.int32, device=META)
        tg.w4a16_grouped_gemm_masked(x, w, s, mm, em, cfg_override=cfg)
    return call


def _fp8xfp8(m, n, k):
    def call(cfg):
        w, s = _w(n, k, 32, e8m0=False)
        a = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=META)
        sa = torch.empty(m, k // 32, dtype=torch.float32, device=META)
        tg.fp8_gemm(a, sa, w, s)
    return call


# name -> (builder, takes a W8A16 variant)
CASES = {
    "wq_a_m1": (_linear(1, 1280, 5120), True),
    "wq_a_m64": (_linear(64, 1280, 5120), True),
    "wq_b_m1": (_linear(1, 32768, 1280), True),
    "wo_b_m16": (_linear(16, 5120, 8192), True),
    "wo_b_m64": (_linear(64, 5120, 8192), True),
    "w13_m128": (_linear(128, 4608, 5120), True),
    "wo_b_m4096": (_linear(4096, 5120, 8192), True),
    "wq_a_m64_f32": (_linear(64, 1280, 5120, e8m0=False), True),
    "wo_b_m64_f32": (_linear(64, 5120, 8192, e8m0=False), True),
    "wq_b_m64_f32": (_linear(64, 32768, 1280, e8m0=False), True),
    "wq_a_m64_bi": (_linear(64, 1280, 5120, bi=True), True),
    "moe_w13_m8": (_moe(48, 8, 4608, 5120), True),
    "moe_w2_m32": (_moe(48, 32, 5120, 2304), True),
    "moe_w13_m8_rows32": (_moe(48, 8, 4608, 5120, rows=32), True),
    "moe_w13_m8_rowscale": (_moe_rows(48, 8, 4608, 5120), False),
    "moe_w2_m8_rowscale": (_moe_rows(48, 8, 5120, 2304), False),
    "moe_w13_m32_rowscale": (_moe_rows(48, 32, 4608, 5120), False),
    "fp8xfp8_wq_a_m64": (_fp8xfp8(64, 1280, 5120), False),
    "moe_w13_m1_fp4": (_moe_fp4(48, 1, 4608, 5120), False),
    "moe_w2_m1_fp4": (_moe_fp4(48, 1, 5120, 2304), False),
}


# --matrix: every constexpr combination the tests and the model reach (compile check: variant x scale format
# x scale rows x split-K x swap x dense/grouped), small shapes
MATRIX = {}
for _e8 in (True, False):
    for _rows in (32, 1):
        for _sk in (1, 3):
            for _swap in (True, False):
                _cfg = dict(SPLIT_K=_sk, SWAP=_swap, BM=16 if _swap else 64, BN=64)
                _tag = f"{'e8m0' if _e8 else 'f32'}_r{_rows}_sk{_sk}_{'swap' if _swap else 'noswap'}"
                MATRIX[f"m_dense_{_tag}"] = (_linear(16, 512, 1024, _rows, _e8), True, _cfg)
                MATRIX[f"m_moe_{_tag}"] = (_moe(4, 8, 512, 1024, _rows, _e8, mmax=64), True, _cfg)


# ---------------------------------------------------------------------------------------------- record
class _Recorder:
    def __init__(self, fn, calls):
        self.fn, self.calls = fn, calls

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.calls.append((self.fn, grid, args, kw))
        return launch


def record_launches(module, names, call) -> list:
    """[(kernel, grid, args, kwargs)] of the launches call() makes of module's kernels `names` (swapped for
    recorders while it runs, nothing launched)."""
    calls: list = []
    saved = {n: getattr(module, n) for n in names}
    try:
        for n, fn in saved.items():
            setattr(module, n, _Recorder(fn, calls))
        call()
    finally:
        for n, fn in saved.items():
            setattr(module, n, fn)
    return calls


def record(builder, cfg):
    """The kernel launches one entry-point call makes (kernels swapped for recorders)."""
    return record_launches(tg, KERNEL_NAMES, lambda: builder(cfg))


# ---------------------------------------------------------------------------------------------- compile
def _specialize(value, param):
    """Triton's JIT specialization of one runtime argument: (type string, attrs)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.nvidia.compiler import CUDABackend
    spec = native_specialize_impl(CUDABackend, value, False, not param.do_not_specialize,
                                  not param.do_not_specialize_on_alignment)
    ty, key = spec[0], spec[1]
    return ty, key


def compile_call(fn, args, kw, arch=90):
    kw = dict(kw)
    options = {k: kw.pop(k) for k in ("num_warps", "num_stages", "num_ctas", "maxnreg") if k in kw}
    bound = dict(zip(fn.arg_names, args))
    bound.update(kw)
    signature, constexprs, attrs = {}, {}, {}
    for i, p in enumerate(fn.params):
        name = p.name
        if name in bound:
            v = bound[name]
        elif p.default is not inspect.Parameter.empty:
            v = p.default
        else:
            raise TypeError(f"{fn.__name__}: missing argument {name}")
        if p.is_constexpr:
            signature[name] = "constexpr"
            constexprs[(i,)] = v
            continue
        ty, key = _specialize(v, p)
        if ty == "constexpr":
            signature[name] = "constexpr"
            constexprs[(i,)] = key
            continue
        signature[name] = ty
        if key == "D":
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


def _ptxas_info(ptx: str, arch: int):
    """(registers, spill store bytes) from ptxas -v, or (None, None)."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas
        tool = get_ptxas(arch)
        path = tool.path if hasattr(tool, "path") else tool
    except Exception:  # noqa: BLE001
        return None, None
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        r = subprocess.run([path, "-v", f"--gpu-name=sm_{arch}a", src, "-o", os.path.join(d, "k.o")],
                           capture_output=True, text=True)
    log = r.stdout + r.stderr
    regs = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes spill stores", log)
    return (int(regs.group(1)) if regs else None), (int(spill.group(1)) if spill else None)


def _main_loop(lines):
    """(first, last) line of the innermost backward-branch region holding the most wgmma/mma: the K loop."""
    labels = {}
    for i, ln in enumerate(lines):
        m = re.match(r"^(\$L__BB\d+_\d+):", ln)
        if m:
            labels[m.group(1)] = i
    best, best_n = None, 0
    for i, ln in enumerate(lines):
        m = re.search(r"\bbra(?:\.uni)?\s+(\$L__BB\d+_\d+);", ln)
        if m and labels.get(m.group(1), i + 1) < i:
            j = labels[m.group(1)]
            n = sum(1 for x in lines[j:i] if x.startswith(("wgmma.mma_async", "mma.sync")))
            if n > best_n or (n == best_n and best and i - j < best[1] - best[0]):
                best, best_n = (j, i), n
    return best


def _sass(cubin: bytes):
    """SASS lines (cuobjdump -sass) or []."""
    try:
        from triton import knobs
        path = knobs.nvidia.cuobjdump.path
    except Exception:  # noqa: BLE001
        return []
    with tempfile.TemporaryDirectory() as d:
        f = os.path.join(d, "k.cubin")
        with open(f, "wb") as fh:
            fh.write(cubin)
        r = subprocess.run([path, "-sass", f], capture_output=True, text=True)
    out = []
    for ln in r.stdout.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", ln)
        if m:
            out.append((int(m.group(1), 16), re.sub(r"^@!?U?P\w+\s+", "", m.group(2).strip())))
    return out


def sass_loop(sass, lines=False):
    """Opcode counts of the SASS K loop: the backward branch region with the most HGMMA/HMMA
    (lines=True: the loop's instructions themselves)."""
    addr = {a: i for i, (a, _) in enumerate(sass)}
    best, best_n = None, 0
    for i, (a, ins) in enumerate(sass):
        m = re.match(r"BRA\S*\s+(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)", ins) or re.match(r"BRA\S*\s+.*?0x([0-9a-f]+)", ins)
        if not m:
            continue
        t = int(m.group(1), 16)
        if t < a and t in addr:
            j = addr[t]
            n = sum(1 for _, x in sass[j:i + 1] if x.startswith(("HGMMA", "QGMMA", "IGMMA", "HMMA", "QMMA", "IMMA")))
            if n > best_n or (n == best_n and best and i - j < best[1] - best[0]):
                best, best_n = (j, i), n
    if not best:
        return [] if lines else {}
    if lines:
        return [x for _, x in sass[best[0]:best[1] + 1]]
    from collections import Counter
    return Counter(x.split()[0].split(".")[0] for _, x in sass[best[0]:best[1] + 1])


def analyze(kernel, arch=90) -> dict:
    ptx, ttgir = kernel.asm["ptx"], kernel.asm["ttgir"]
    lines = [re.sub(r"^@!?%p\d+\s+", "", ln.strip()) for ln in ptx.splitlines()]   # drop predicates

    def n_instr(prefix):
        return sum(1 for ln in lines if ln.startswith(prefix))

    bufs = sorted({int(b) for b in re.findall(r"ttg\.local_alloc\s*:\s*\(\)\s*->\s*!ttg\.memdesc<(\d+)x\d+x", ttgir)})
    waits = [int(p) for p in re.findall(r"warp_group_dot_wait[^\n]*pendings = (\d+)", ttgir)]
    regs, spill = _ptxas_info(ptx, arch)
    loop = _main_loop(lines)
    body = [x for x in lines[loop[0]:loop[1] + 1] if x.endswith(";") and not x.startswith(("//", "."))] if loop else []
    sass = _sass(kernel.asm["cubin"])
    sl = sass_loop(sass)
    return {
        "sass_lines": sass_loop(sass, lines=True),
        "sass": sum(sl.values()) if sl else "-",
        "sass_ops": sl,
        "loop": len(body),
        "cp.async": n_instr("cp.async.ca.shared") + n_instr("cp.async.cg.shared"),
        "bulk": n_instr("cp.async.bulk"),
        "wgmma": n_instr("wgmma.mma_async"),
        "mma.sync": n_instr("mma.sync"),
        "ld.global": n_instr("ld.global"),
        "ldg.loop": sum(1 for x in body if x.startswith("ld.global")),
        "async_ir": ttgir.count("ttg.async_copy_global_to_local") + ttgir.count("async_tma_copy_global_to_local"),
        "bufs": "/".join(map(str, bufs)) or "-",
        "wait": max(waits) if waits else "-",
        "smem": kernel.metadata.shared,
        "regs": regs,
        "spill": spill,
    }


COLS = ["sass", "loop", "cp.async", "bulk", "wgmma", "mma.sync", "ld.global", "ldg.loop", "bufs", "wait", "smem", "regs", "spill"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default=",".join(CASES), help="comma list (see --list)")
    ap.add_argument("--variants", default=",".join(tg.W8A16_VARIANTS), help="W8A16 variants to compile")
    ap.add_argument("--cfg", default="", help="extra launch config, e.g. NUM_STAGES=3,num_warps=8")
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--dump", default="", help="folder to write each kernel's ttgir and ptx to")
    ap.add_argument("--all-kernels", action="store_true", help="also the split-K reduce kernel")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--ops", action="store_true", help="print the SASS opcode mix of each K loop")
    ap.add_argument("--sass", action="store_true", help="print each K loop's SASS")
    ap.add_argument("--matrix", action="store_true", help="compile every constexpr combination (small shapes)")
    args = ap.parse_args(argv)
    cases = dict(CASES)
    if args.matrix:
        cases = {k: v for k, v in MATRIX.items()}
        args.cases = ",".join(MATRIX)
    if args.list:
        print("\n".join(list(CASES) + list(MATRIX)))
        return 0
    extra = {}
    for item in filter(None, args.cfg.split(",")):
        k, v = item.split("=")
        extra[k] = v if not v.lstrip("-").isdigit() else int(v)
    print(f"triton {triton.__version__}, sm_{args.arch}")
    hdr = f"{'case':20s} {'var':4s} {'kernel':18s} {'config':44s} " + " ".join(f"{c:>9s}" for c in COLS)
    print(hdr)
    print("-" * len(hdr))
    results = []
    for case in filter(None, args.cases.split(",")):
        builder, takes_variant, *case_cfg = cases[case] if case in cases else MATRIX[case]
        for var in (args.variants.split(",") if takes_variant else ["-"]):
            cfg = dict(case_cfg[0]) if case_cfg else {}
            cfg.update(extra)
            if takes_variant:
                cfg["VARIANT"] = var
            for fn, grid, a, kw in record(builder, cfg):
                if fn.__name__ == "splitk_reduce_kernel" and not args.all_kernels:
                    continue
                short = {k: kw[k] for k in ("BM", "BN", "BK", "SWAP", "SB_ROWS", "SB_E8M0", "num_warps") if k in kw}
                conf = (f"BM{short.get('BM', '')} BN{short.get('BN', '')} BK{short.get('BK', '')} "
                        f"{'swap ' if short.get('SWAP') else ''}R{short.get('SB_ROWS', '')} "
                        f"{'e8m0 ' if short.get('SB_E8M0') else ''}w{short.get('num_warps', 4)} "
                        f"sk{a[fn.arg_names.index('SPLIT_K')] if 'SPLIT_K' in fn.arg_names else ''}")
                try:
                    k = compile_call(fn, a, kw, args.arch)
                    r = analyze(k, args.arch)
                except Exception as e:  # noqa: BLE001
                    print(f"{case:20s} {var:4s} {fn.__name__[:18]:18s} {conf:44s} FAILED {repr(e)[:300]}")
                    results.append(dict(case=case, variant=var, kernel=fn.__name__, error=repr(e)))
                    continue
                print(f"{case:20s} {var:4s} {fn.__name__[:18]:18s} {conf:44s} "
                      + " ".join(f"{str(r[c]):>9s}" for c in COLS), flush=True)
                if args.ops and r["sass_ops"]:
                    print("    " + ", ".join(f"{o}:{c}" for o, c in r["sass_ops"].most_common(24)))
                if args.sass:
                    print("\n".join("      " + ln for ln in r["sass_lines"]))
                results.append(dict(case=case, variant=var, kernel=fn.__name__, config=conf,
                                    **{c: v for c, v in r.items() if c != "sass_lines"}))
                if args.dump:
                    os.makedirs(args.dump, exist_ok=True)
                    stem = os.path.join(args.dump, f"{case}_{var}_{fn.__name__}")
                    for ext in ("ttgir", "ptx"):
                        with open(f"{stem}.{ext}", "w") as f:
                            f.write(k.asm[ext])
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
