"""Static issue model of the CUDA GEMM kernels: how many instructions a consumer warp issues per K = 128
stage of its main loop, and the ceiling that puts on the tensor cores (no GPU needed: nvcc + cuobjdump).

An SM90 sub-partition issues one warp instruction a cycle, and each consumer warpgroup has one warp on
every sub-partition. A stage of an m64nNk32 consumer is 4 wgmmas = 4 * N / 2 tensor cycles on its
sub-partition's tensor core; with W consumer warpgroups a sub-partition issues W warps' loop bodies
while its tensor core runs W * 2N cycles. Where the issue count is higher, the kernel is issue-bound:

    ceiling (of the FP8 peak) = min(1, tensor cycles / issue cycles) = min(1, 2N / instructions per stage)

(per-32 promotion alone costs N / 2 FFMAs a slice = the wgmma's own cycles, so 2N / (2N + overhead) is
the best an exact kernel does). The loop is the backward branch with the densest wgmmas (QGMMA / HGMMA,
at least a stage's 4); its instructions are counted by opcode.

    python3 perf/sass_issue_model.py                       # every entry of both kernels
    python3 perf/sass_issue_model.py --entries fp8_gemm_sm90_bn128 fp8_gemm_sm90_bn128_ts
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kernels import cuda_driver  # noqa: E402

KERNELS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "kernels", "cuda")
SOURCES = ("fp8_gemm_sm90.cu", "fp8_decode_sm90.cu")
_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)([^;]*);")
_WGMMA = ("QGMMA", "HGMMA")


def find_cuobjdump() -> str | None:
    """cuobjdump from PATH, the CUDA toolkit, or the copy Triton's wheel ships."""
    cand = [shutil.which("cuobjdump") or ""]
    nvcc = cuda_driver.find_nvcc()
    if nvcc:
        cand.append(os.path.join(os.path.dirname(nvcc), "cuobjdump"))
    try:
        import triton
        cand.append(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump"))
    except ImportError:
        pass
    return next((c for c in cand if c and os.path.exists(c)), None)


def sass(cubin: str, entry: str) -> list[tuple[int, str, str]]:
    """(address, opcode, operands) of entry's SASS."""
    tool = find_cuobjdump()
    if tool is None:
        raise RuntimeError("cuobjdump not found (CUDA toolkit or the triton wheel)")
    out = subprocess.run([tool, "-sass", "-fun", entry, cubin], capture_output=True, text=True, check=True).stdout
    rows = []
    for m in _LINE.finditer(out):
        rows.append((int(m.group(1), 16), m.group(3), m.group(4)))
    return rows


def main_loop(rows: list[tuple[int, str, str]]) -> tuple[int, int] | None:
    """(start, end) addresses of the K loop: of the backward branches whose body holds at least 4 wgmmas
    (a stage), the one with the most wgmmas per instruction (the innermost; an outer loop's body adds
    its prologue and epilogue)."""
    best, best_density = None, 0.0
    for addr, op, args in rows:
        if not op.startswith("BRA"):
            continue
        m = re.search(r"0x([0-9a-f]+)", args)
        if m is None:
            continue
        target = int(m.group(1), 16)
        if target >= addr:
            continue
        body = [o for a, o, _ in rows if target <= a <= addr]
        n = sum(1 for o in body if o.split(".")[0] in _WGMMA)
        if n >= 4 and n / len(body) > best_density:
            best, best_density = (target, addr), n / len(body)
    return best


def wgmma_n(op: str) -> int:
    """N of an m64nNk32 QGMMA opcode (QGMMA.64x128x32...)."""
    m = re.match(r"[QH]GMMA\.64x(\d+)x", op)
    return int(m.group(1)) if m else 0


def loop_mix(cubin: str, entry: str) -> dict:
    rows = sass(cubin, entry)
    span = main_loop(rows)
    if span is None:
        return {"entry": entry, "found": False}
    body = [(a, o) for a, o, _ in rows if span[0] <= a <= span[1]]
    ops = collections.Counter(o.split(".")[0] for _, o in body)
    mmas = [o for _, o in body if o.split(".")[0] in _WGMMA]
    tensor = sum(wgmma_n(o) // 2 for o in mmas)           # m64nNk32: N / 2 cycles a sub-partition
    stages = max(1, len(mmas) // 4) if mmas else 1
    return {"entry": entry, "found": True, "instructions": len(body), "wgmmas": len(mmas),
            "stages": stages, "per_stage": len(body) / stages, "ffma_per_stage": ops["FFMA"] / stages,
            "tensor_cycles_per_stage": tensor / stages, "ceiling": min(1.0, tensor / len(body)),
            "ops": ops}


def entries_of(src: str) -> list[str]:
    text = open(src).read()
    return re.findall(r"^FP8_(?:GEMM|DECODE)(?:_TS)?_ENTRY\((\w+),", text, flags=re.M)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--entries", nargs="*", help="entry points (default: every entry of both kernels)")
    ap.add_argument("--top", type=int, default=8, help="opcodes listed per entry")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory():
        for name in SOURCES:
            src = os.path.join(KERNELS, name)
            cubin, _ = cuda_driver.compile_cubin(src)
            for entry in entries_of(src):
                if args.entries and entry not in args.entries:
                    continue
                r = loop_mix(cubin, entry)
                if not r["found"]:
                    print(f"{entry:36s} no wgmma loop found")
                    continue
                top = ", ".join(f"{o} {n / r['stages']:.0f}" for o, n in r["ops"].most_common(args.top))
                print(f"{entry:36s} {r['per_stage']:6.0f} instr/stage ({r['ffma_per_stage']:.0f} FFMA), "
                      f"{r['tensor_cycles_per_stage']:4.0f} tensor cycles -> issue ceiling {r['ceiling']:.2f}"
                      f" of the FP8 peak | {top}")


if __name__ == "__main__":
    main()
