"""Kernel launches of one decode step on the fast path, counted on a CPU (no GPU needed): the static decode
step the engine captures in a CUDA graph (bench_model_decode.decode_step), run with DEEPINFER_KERNELS=fast
under Triton's interpreter, every Triton launch and every torch op that launches a kernel counted by where
it comes from.

    python perf/decode_launches.py [--preset small] [--batch 4] [--ctx 300] [--against REV ...] [--top 25]

--against REV counts the same step on another git revision (a temporary worktree, the same counter) and
prints the two side by side: the launches a change removed. Why count: in a graph-replayed decode step each
small kernel costs ~2-4 us whatever it does (H200, 2026-12-04: 545 kernels in a 4.83 ms batch-64 step, index
gathers 3.2 us each), so the glue's launch count is a large part of what separates the step from its bytes.
The counts are the CPU path's, which binds the same select.py choices as the GPU except the CUDA-only
kernels (cuBLAS / the CUDA FP8 GEMMs count as the one torch op each of them replaces).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
# torch ops that launch nothing (views and metadata)
NO_LAUNCH = ("view", "alias", "expand", "unsqueeze", "squeeze", "slice", "select", "split", "permute", "as_strided",
             "unflatten", "flatten", "transpose", "t.default", "detach", "lift_fresh", "_unsafe_view", "reshape",
             "unbind", "narrow", "chunk", "_to_copy.default", "is_same_size", "sym_size", "sym_stride", "numel",
             "dim.default", "empty", "item", "_local_scalar_dense")


def count(tree: str, preset: str, batch: int, ctx: int) -> dict:
    """{'triton': {kernel: n}, 'torch': {'op @ file:line': n}} of one decode step of `tree`'s deepinfer."""
    # this tree's packages, not the editable install's (its finder maps deepinfer.kernels / .recipe / .ensemble
    # to the checkout it was installed from): the same links perf/device_env.sh makes
    if os.path.realpath(tree) != os.path.realpath(REPO):
        sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in getattr(f, "__module__", "")]
        for pkg in ("kernels", "recipe", "ensemble"):
            link = os.path.join(tree, "deepinfer", pkg)
            if not os.path.exists(link):
                os.symlink(os.path.join("..", pkg), link)
    sys.path[:0] = [tree, HERE]
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from triton.runtime.interpreter import InterpretedFunction

    import deepinfer                     # first: bench_model_decode puts this checkout on sys.path
    assert os.path.realpath(deepinfer.__file__).startswith(os.path.realpath(tree) + os.sep), deepinfer.__file__
    from bench_model_decode import decode_step
    from benchutil import dummy_model
    from deepinfer.cache.model_caches import ModelCaches

    # the CUDA load's choices on a CPU: release FP8 bytes, the masked MoE on row-scaled stacks, fused input
    # linears, wo_a on FP8, the dense linears held in bf16 (the engine's default), bf16 dense compute
    from deepinfer.kernels import select
    from deepinfer.model import layers
    layers.compute_dtype = select._dense_dtype = lambda _: torch.bfloat16
    torch.manual_seed(0)
    model = dummy_model(preset, device="cpu", dense_weights="bf16", weight_format="fp8", moe_masked=True,
                        fuse_linears=True, expert_row_scales=True, wo_a_fp8=True)
    max_len, bt = ctx + 64, 64
    caches = ModelCaches.allocate(model.args, batch + 1, (batch + 1) * -(-max_len // bt), bt, "cpu", scratch=True)
    step = decode_step(model, caches, batch, ctx, max_len, bt, device="cpu")
    step()                                                   # first call: tables grown, caches of weights made

    triton_n, torch_n = collections.Counter(), collections.Counter()
    inside = [0]
    run = InterpretedFunction.run

    def counted_run(self, *args, **kwargs):
        model = [f for f in traceback.extract_stack() if "/deepinfer/model/" in f.filename]
        triton_n[self.fn.__name__ + (f" @ {os.path.basename(model[-1].filename)}:{model[-1].name}" if model else "")] += 1
        inside[0] += 1
        try:
            return run(self, *args, **kwargs)
        finally:
            inside[0] -= 1

    def storages(obj) -> set:
        flat = obj if isinstance(obj, (tuple, list)) else [obj]
        return {t.untyped_storage().data_ptr() for t in flat if isinstance(t, torch.Tensor)}

    class TorchOps(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = str(func)
            if inside[0] or any(s in name for s in NO_LAUNCH):
                return out
            # a launch writes: in place (name_) or into new memory; an op returning its input (a .to() to
            # the dtype it has) launches nothing
            ins = storages(list(args) + list((kwargs or {}).values()))
            if name.split(".")[-2].endswith("_") or not storages(out) <= ins:
                frames = [f for f in traceback.extract_stack() if f.filename.startswith(tree + os.sep)
                          and not any(s in f.filename for s in ("/perf/", "/.venv/", "site-packages"))]
                where = "?"
                if frames:     # the package's links (deepinfer/kernels -> kernels) named one way in every tree
                    rel = os.path.relpath(frames[-1].filename, tree).replace("deepinfer/kernels/", "kernels/")
                    where = f"{rel}:{frames[-1].name}"
                torch_n[f"{name.removeprefix('aten.')} @ {where}"] += 1
            return out

    InterpretedFunction.run = counted_run
    try:
        with torch.inference_mode(), TorchOps():
            step()
    finally:
        InterpretedFunction.run = run
    return {"triton": dict(triton_n), "torch": dict(torch_n)}


def count_in_subprocess(tree: str, a) -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1", DEEPINFER_KERNELS="fast", PYTHONPATH=tree)
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        subprocess.run([sys.executable, __file__, "--count-only", f.name, "--tree", tree, "--preset", a.preset,
                        "--batch", str(a.batch), "--ctx", str(a.ctx)], env=env, check=True)
        return json.load(open(f.name))


def worktree(rev: str) -> str:
    d = tempfile.mkdtemp(prefix=f"launches-{rev[:12]}-")
    subprocess.run(["git", "-C", REPO, "worktree", "add", "--detach", "-f", d, rev], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return d


def totals(c: dict) -> tuple[int, int]:
    return sum(c["triton"].values()), sum(c["torch"].values())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small", help="a checkpoint preset (small: dim 256, the fast paths' shapes)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--ctx", type=int, default=300)
    p.add_argument("--against", nargs="*", default=[], help="git revisions counted side by side with this tree")
    p.add_argument("--top", type=int, default=25, help="torch launch sites listed")
    p.add_argument("--tree", default=REPO, help=argparse.SUPPRESS)
    p.add_argument("--count-only", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.count_only:
        json.dump(count(a.tree, a.preset, a.batch, a.ctx), open(a.count_only, "w"))
        return

    runs = {"this tree": count_in_subprocess(REPO, a)}
    made = []
    for rev in a.against:
        made.append(worktree(rev))
        runs[rev] = count_in_subprocess(made[-1], a)
    for d in made:
        subprocess.run(["git", "-C", REPO, "worktree", "remove", "--force", d], check=False)

    mine = runs["this tree"]
    print(f"decode step, preset {a.preset}, batch {a.batch}, position {a.ctx}: kernel launches")
    print(f"{'tree':>14} {'Triton':>7} {'torch':>7} {'total':>7} {'this tree / it':>15}")
    base = sum(totals(mine))
    for name, c in runs.items():
        tr, to = totals(c)
        print(f"{name[:14]:>14} {tr:>7} {to:>7} {tr + to:>7} {base / (tr + to):>15.2f}")
    print("\nTriton kernels (this tree):")
    for k, n in sorted(mine["triton"].items(), key=lambda kv: -kv[1]):
        print(f"  {n:4d}  {k}")
    print(f"\ntorch launch sites (this tree, top {a.top}):")
    for k, n in sorted(mine["torch"].items(), key=lambda kv: -kv[1])[:a.top]:
        print(f"  {n:4d}  {k}")
    for name, c in list(runs.items())[1:]:
        gone = collections.Counter(c["torch"])
        gone.subtract(collections.Counter(mine["torch"]))
        fewer = [(k, n) for k, n in gone.items() if n > 0]
        print(f"\ntorch launch sites {name} has and this tree does not (top {a.top}):")
        for k, n in sorted(fewer, key=lambda kv: -kv[1])[:a.top]:
            print(f"  {n:4d}  {k}")


if __name__ == "__main__":
    main()
