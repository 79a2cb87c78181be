"""Batch-invariant matmuls: a row's result does not depend on how many rows share the GEMM.

Why: CPU GEMMs (MKL / oneDNN) pick a kernel and a blocking from the shape, so row i of x @ W
differs in the last bits between M=1 (a GEMV) and M=16 (a blocked GEMM), and even with the position
of the row inside a padded block (measured: tests/kernels/test_batch_invariant.py). In an engine a
request's rows share GEMMs with whatever else is scheduled, so its logits, and with them its tokens,
would depend on the batch. The same holds on CUDA (split-K and tile choice by shape).

The fix here, for the torch path: every mm / addmm / bmm computes each output row on its own
(a [1, K] x [K, N] GEMV, always the same kernel and reduction order), under a TorchDispatchMode, so
the model code needs no change:

    with batch_invariant_mode():
        logits = model(batch, caches)

Cost: one GEMV call per row per matmul (fine for the CPU tiny model and for tests; the CUDA path
needs fixed-tile, no-split-K GEMMs instead: deepinfer/sample/BATCH_INVARIANCE.md).
Everything else the model does per row (RMSNorm, softmax, elementwise) was measured row-invariant on
CPU torch; full-vocabulary-length row sums are not (the sampler avoids them).
"""

from __future__ import annotations

import contextlib
import threading

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten


def mm_rows_ref(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[M, K] @ [K, N] -> [M, N], one row at a time (the batch-invariant reference and implementation)."""
    if a.shape[0] <= 1:
        return torch.mm(a, b)
    return torch.cat([torch.mm(a[i:i + 1], b) for i in range(a.shape[0])])


def bmm_rows_ref(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[G, M, K] @ [G, K, N] -> [G, M, N], every (g, row) on its own."""
    return torch.stack([mm_rows_ref(a[g], b[g]) for g in range(a.shape[0])])


def linear_rows_ref(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear with every row of x ([..., K]) on its own."""
    flat = x.reshape(-1, x.shape[-1])
    if flat.shape[0] <= 1:
        out = torch.nn.functional.linear(flat, w, bias)
    else:
        out = torch.cat([torch.nn.functional.linear(flat[i:i + 1], w, bias) for i in range(flat.shape[0])])
    return out.reshape(*x.shape[:-1], w.shape[0])


def einsum_rows_ref(equation: str, operands) -> torch.Tensor | None:
    """einsum sliced along operand 0's leading index when it leads the output and only operand 0 has it
    (the token dim: "nhd,ed->nhe", "tgd,grd->tgr"); None when the equation has no such index."""
    eq = equation.replace(" ", "")
    if "->" not in eq or "." in eq:
        return None
    ins, out = eq.split("->")
    ins = ins.split(",")
    lead = ins[0][:1]
    if not lead or not out.startswith(lead) or any(lead in s for s in ins[1:]):
        return None
    x = operands[0]
    if x.shape[0] <= 1:
        return torch.einsum(equation, *operands)
    return torch.cat([torch.einsum(equation, x[i:i + 1], *operands[1:]) for i in range(x.shape[0])])


def matmul_rows_ref(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.matmul with every row of a (its dim -2) on its own."""
    if a.dim() < 2 or a.shape[-2] <= 1:
        return torch.matmul(a, b)
    if b.dim() == 2:
        return mm_rows_ref(a.reshape(-1, a.shape[-1]), b).reshape(*a.shape[:-1], b.shape[-1])
    return torch.cat([torch.matmul(a[..., i:i + 1, :], b) for i in range(a.shape[-2])], dim=-2)


# CPU elementwise kernels run a vectorized body and a scalar tail whose transcendentals differ in the
# last ulp, so an element's sigmoid / exp / ... depends on where it falls in the tensor, i.e. on how
# many rows share the call (measured: mHC pre/post of one token differ between a 7- and a 300-token
# step). These run on a contiguous copy padded to whole vectors, so every element takes the body.
# Which ops differ that way depends on the CPU and its libm (on an AVX-512 Xeon, 2026-12-06: softplus, gelu,
# pow and exp2 too; tests/kernels/test_batch_invariant.py sweeps every op here over tensor lengths).
_UNARY = {aten.sigmoid.default, aten.exp.default, aten.log.default, aten.rsqrt.default, aten.sqrt.default,
          aten.tanh.default, aten.silu.default, aten.expm1.default, aten.log1p.default, aten.erf.default,
          aten.softplus.default, aten.gelu.default, aten.pow.Tensor_Scalar, aten.exp2.default}
_PAD = 256
# calls below torch's parallel grain (at::internal::GRAIN_SIZE, 32,768 elements) run on one thread: a longer
# tensor goes in pieces of this many, else each thread's share would end in its own scalar tail
_PIECE = 16384


def unary_padded_ref(func, x: torch.Tensor, *scalars, **kwargs) -> torch.Tensor:
    """func(x, *scalars, **kwargs) with every element in the kernel's vectorized body (see _UNARY);
    scalars / kwargs: the op's non-tensor arguments (softplus's beta and threshold, gelu's approximate)."""
    flat = x.contiguous().view(-1)
    n = flat.numel()
    padded = torch.cat([flat, flat.new_zeros(-n % _PAD + _PAD)])   # never a tail, even for n = 0
    if padded.numel() <= _PIECE:
        return func(padded, *scalars, **kwargs)[:n].view(x.shape)
    out = torch.cat([func(p, *scalars, **kwargs) for p in padded.split(_PIECE)])
    return out[:n].view(x.shape)


def _add_scaled(rows_ref, bias, a, b, alpha=1, beta=1):
    """addmm / baddbmm: beta * bias + alpha * (a @ b), the product row by row."""
    out = rows_ref(a, b)
    return (out * alpha if alpha != 1 else out) + (bias if beta == 1 else beta * bias)


class BatchInvariantMode(TorchDispatchMode):
    """Routes aten linear / matmul / einsum / mm / addmm / bmm / baddbmm to the row-by-row versions (under
    inference_mode, composite ops such as linear and einsum reach the mode undecomposed), and CPU
    transcendentals to their padded form."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _UNARY and args[0].is_floating_point() and not args[0].is_cuda \
                and not any(isinstance(a, torch.Tensor) for a in args[1:]):
            return unary_padded_ref(func, *args, **kwargs)
        if func is aten.linear.default:
            return linear_rows_ref(*args, **kwargs)
        if func is aten.matmul.default:
            return matmul_rows_ref(*args)
        if func is aten.einsum.default:
            out = einsum_rows_ref(args[0], args[1])
            if out is not None:
                return out
        if func is aten.mm.default:
            return mm_rows_ref(*args)
        if func is aten.mm.dtype:                     # bf16 x bf16 -> fp32 (the CUDA head): the fp32 values
            out_dtype = kwargs.get("out_dtype", args[2] if len(args) > 2 else torch.float32)
            return mm_rows_ref(args[0].float(), args[1].float()).to(out_dtype)
        if func is aten.addmm.default:
            return _add_scaled(mm_rows_ref, *args, **kwargs)
        if func is aten.bmm.default:
            return bmm_rows_ref(*args)
        if func is aten.baddbmm.default:
            return _add_scaled(bmm_rows_ref, *args, **kwargs)
        return func(*args, **kwargs)


_state = threading.local()


def active() -> bool:
    """True inside batch_invariant_mode() on this thread: the Triton GEMMs (which no dispatch mode
    sees) then take their fixed-split configs (kernels/select.py)."""
    return getattr(_state, "depth", 0) > 0


@contextlib.contextmanager
def batch_invariant_mode(enabled: bool = True):
    """Within the block, matmuls are computed row by row (see module docstring), and the fast GEMMs
    use tile shapes and split counts that depend on (N, K) only. Per thread."""
    if not enabled:
        yield
        return
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        with BatchInvariantMode():
            yield
    finally:
        _state.depth -= 1
