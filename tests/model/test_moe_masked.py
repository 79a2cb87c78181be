"""MoE masked form (DeepGEMM's masked layout over the FP8 expert stacks, capacity C = T): the same
bits as the per-expert loop and the grouped form of the dense model on a CPU, for any routing
(experts with no token, every token on the same experts, a group filling its whole capacity), and
no host read anywhere in the forward (what CUDA-graph capture of a decode step needs)."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from deepinfer.model.loader import load_model


@pytest.fixture(scope="module")
def models(tiny_checkpoint):
    torch.set_num_threads(1)
    dense = load_model(tiny_checkpoint, progress=False, weight_format="dense")
    fp8 = load_model(tiny_checkpoint, progress=False, weight_format="fp8", moe_masked=True)
    return dense, fp8


@pytest.fixture(scope="module")
def row_scaled(tiny_checkpoint):
    return load_model(tiny_checkpoint, progress=False, weight_format="fp8", moe_masked=True, expert_row_scales=True)


def _layers(model):
    """A window-only layer, a ratio-2 layer, the last backbone layer, a DSpark layer (4 experts, top-2)."""
    return [model.layers[0], model.layers[5], model.layers[-1], model.mtp[0]]


def _routing(moe, x, kind):
    """(weights [T, K] fp32, indices [T, K]): the gate's own, or every token on the same experts."""
    w, idx = moe.gate(x, None)
    if kind == "same":
        idx = torch.arange(idx.shape[1]).flip(0).expand_as(idx).contiguous()   # experts K-1 .. 0
        w = torch.rand(idx.shape, generator=torch.Generator().manual_seed(1)) + 0.1
    return w, idx


@pytest.mark.parametrize("kind", ["gate", "same"])
@pytest.mark.parametrize("T", [1, 3, 17, 64])
def test_masked_equals_loop_and_grouped(models, T, kind):
    dense, fp8 = models
    torch.manual_seed(T)
    for ld, lf in zip(_layers(dense), _layers(fp8)):
        md, mf = ld.ffn, lf.ffn
        x = torch.randn(T, dense.args.dim).to(torch.bfloat16)
        w, idx = _routing(md, x, kind)
        counts = torch.bincount(idx.flatten(), minlength=md.n_experts)
        if kind == "same" or T == 1:
            assert (counts == 0).any()                               # experts with no token
        if kind == "same":
            assert counts.max() == T                                 # a group fills its capacity C = T
        got = mf._routed_masked(x, w, idx)
        assert md._stacked(x.device) is not None
        assert torch.equal(got, md._routed_loop(x, w, idx))          # dense per-expert loop
        assert torch.equal(got, md._routed_grouped(x, w, idx))       # dense grouped (padded bmm)
        assert torch.equal(got, mf._routed_loop(x, w, idx))          # loop over the FP8 stacks' views
        assert torch.equal(mf(x), md(x))                             # forward: combine + shared expert


# Ops that read device memory from the host on CUDA (a sync; illegal during graph capture).
SYNC_ATEN = {"aten::_local_scalar_dense", "aten::item", "aten::nonzero", "aten::nonzero_static",
             "aten::masked_select", "aten::bincount", "aten::_unique2", "aten::unique_dim",
             "aten::unique_consecutive", "aten::is_nonzero", "aten::equal"}
SYNC_METHODS = {"tolist", "item", "numpy", "__array__", "__int__", "__float__", "__bool__", "__index__", "cpu"}


class HostSyncRecorder(TorchDispatchMode):
    """aten calls that sync on CUDA: scalar reads, data-dependent output sizes (nonzero, boolean
    indexing, bincount, repeat_interleave without output_size)."""

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        if name in SYNC_ATEN:
            self.calls.append(name)
        elif name == "aten::repeat_interleave" and isinstance(args[0 if func._overloadname.startswith("Tensor") else 1],
                                                             torch.Tensor) and kwargs.get("output_size") is None:
            self.calls.append(name)                                    # tensor repeats, output size unknown
        elif name in ("aten::index", "aten::index_put", "aten::index_put_"):
            if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1]):
                self.calls.append(name + " (boolean mask)")
        return func(*args, **kwargs)


class HostReadRecorder(TorchFunctionMode):
    """Tensor -> Python conversions that never reach the dispatcher on a CPU (tolist, numpy)."""

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in SYNC_METHODS:
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


def _host_reads(fn) -> list[str]:
    with HostReadRecorder() as py, HostSyncRecorder() as aten:
        fn()
    return py.calls + aten.calls


@pytest.mark.parametrize("T", [1, 17])
def test_masked_forward_has_no_host_sync(models, T):
    _, fp8 = models
    x = torch.randn(T, fp8.args.dim).to(torch.bfloat16)
    for layer in _layers(fp8):
        moe = layer.ffn
        assert moe.masked and moe.stacks is not None
        assert _host_reads(lambda: moe(x)) == []                       # gate, masked experts, combine, shared
        image_mask = torch.arange(T) % 2 == 0
        assert _host_reads(lambda: moe(x, image_mask)) == []


def test_sync_check_catches_the_loop(models):
    """The recorders are not blind: the per-expert loop's counts.tolist() is caught, and so is a
    scalar read or a boolean mask."""
    _, fp8 = models
    moe = fp8.layers[0].ffn
    x = torch.randn(5, fp8.args.dim).to(torch.bfloat16)
    w, idx = moe.gate(x, None)
    assert "tolist" in _host_reads(lambda: moe._routed_loop(x, w, idx))
    assert "aten::_local_scalar_dense" in _host_reads(lambda: int(idx.max()))
    assert "aten::index (boolean mask)" in _host_reads(lambda: x[idx[:, 0] > 2])
    assert "aten::repeat_interleave" in _host_reads(lambda: x.repeat_interleave(idx[:, 0], dim=0))
    assert _host_reads(lambda: x.repeat_interleave(2, dim=0)) == []


@pytest.mark.parametrize("kind", ["gate", "same"])
@pytest.mark.parametrize("T", [1, 17, 64])
def test_fp8_masked_form_same_bits_on_the_references(row_scaled, monkeypatch, T, kind):
    """The masked MoE's FP8 x FP8 data flow (the CUDA path's: dispatch and SwiGLU into e4m3 slabs with their
    scales transposed by slab row, the masked GEMM on the row-scaled stacks), forced on a CPU where each op
    runs its reference: the W8A16 form's bits, and no host read."""
    import deepinfer.model.ops as ops
    torch.manual_seed(T)
    for moe, x, w, idx, base, base_fwd in _row_scaled_steps(row_scaled, T, kind):
        with monkeypatch.context() as m:
            m.setattr(ops, "masked_moe_fp8_takes", lambda *a: True)
            gemms = []
            m.setattr(ops, "fp8_masked_moe_gemm", lambda *a, _f=ops.fp8_masked_moe_gemm: gemms.append(a) or _f(*a))
            assert torch.equal(moe._routed_masked(x, w, idx), base)
            assert len(gemms) == 2 and all(a[0].dtype == torch.float8_e4m3fn for a in gemms)   # the FP8 form ran
            assert torch.equal(moe(x), base_fwd)
            assert _host_reads(lambda: moe(x)) == []


def _row_scaled_steps(model, T: int, kind: str):
    """(moe, x, weights, indices, the masked form's per-pair outputs, the forward's output) of a T-token step
    through each layer whose stacks take one scale a row (at least one)."""
    ran = 0
    for layer in _layers(model):
        moe = layer.ffn
        if moe.stacks.r13 is None or moe.stacks.r2 is None:
            continue
        x = torch.randn(T, model.args.dim).to(torch.bfloat16)
        w, idx = _routing(moe, x, kind)
        yield moe, x, w, idx, moe._routed_masked(x, w, idx), moe(x)
        ran += 1
    assert ran, "no layer's stacks took one scale a row"


@pytest.mark.parametrize("T", [1, 2, 3, 17])
def test_odd_steps_padded_onto_the_fp8_form(row_scaled, monkeypatch, T):
    """PAD_MASKED_SLABS: a step of T tokens (not a multiple of 4; the FP8 x FP8 form's slab rule) runs that form
    padded to a multiple of 4 with zero-weight tokens (forced on a CPU with the GPU's rule, each op on its
    reference): the W8A16 form's bits for the real tokens, through the forward's combine and the per-pair
    outputs, with no host read; off, the step stays on W8A16."""
    import deepinfer.model.moe as moe_mod
    import deepinfer.model.ops as ops
    torch.manual_seed(100 + T)
    for moe, x, w, idx, base, base_fwd in _row_scaled_steps(row_scaled, T, "gate"):
        for pad_on in (False, True):
            with monkeypatch.context() as m:
                m.setattr(moe_mod, "PAD_MASKED_SLABS", pad_on)
                m.setattr(ops, "masked_moe_fp8_takes", lambda x, *a: x.shape[0] % 4 == 0)    # the GPU's rule
                gemms = []
                m.setattr(ops, "fp8_masked_moe_gemm", lambda *a, _f=ops.fp8_masked_moe_gemm: gemms.append(a) or _f(*a))
                got = moe._routed_masked(x, w, idx)
                fwd = moe(x)
                assert torch.equal(got, base) and torch.equal(fwd, base_fwd), (pad_on, T)
                if pad_on:      # both projections on FP8 slabs of C = T rounded up to 4, in each of the two calls
                    assert len(gemms) == 4 and all(a[0].dtype == torch.float8_e4m3fn and a[0].shape[1] == T + (-T % 4)
                                                   for a in gemms), [tuple(a[0].shape) for a in gemms]
                    assert _host_reads(lambda: moe(x)) == []
                else:
                    assert gemms == []


def test_row_scaled_stacks_same_bits(models, row_scaled):
    """Expert stacks re-expressed with one scale per row (what a CUDA load does: the masked GEMMs' K loop
    then reads no scale) hold the same values: the masked form, the loop over the experts' Linear views
    and the whole MoE give the per-32 stacks' bits."""
    _, fp8 = models
    moes = [layer.ffn for layer in _layers(row_scaled)]
    assert all(m.stacks.r13 is not None and m.stacks.r2 is not None for m in moes)
    assert all(m.stacks.r13.shape == (m.n_experts, m.stacks.w13.shape[1], 1) for m in moes)
    torch.manual_seed(5)
    for lr, lf in zip(_layers(row_scaled), _layers(fp8)):
        mr, mf = lr.ffn, lf.ffn
        assert not torch.equal(mr.stacks.w13.view(torch.uint8), mf.stacks.w13.view(torch.uint8))  # re-expressed
        x = torch.randn(17, fp8.args.dim).to(torch.bfloat16)
        w, idx = _routing(mf, x, "gate")
        got = mr._routed_masked(x, w, idx)
        assert torch.equal(got, mf._routed_masked(x, w, idx))
        assert torch.equal(mr._routed_loop(x, w, idx), got)
        assert torch.equal(mr(x), mf(x))
