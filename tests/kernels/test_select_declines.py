"""A fast path whose shape rules a call breaks takes the torch reference and says so once per (op, rule)
in the log (kernels/select.py _fast_for). Under Triton's interpreter (CPU tensors take the fast paths),
in a subprocess: TRITON_INTERPRET and DEEPINFER_KERNELS are read at import."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

SCRIPT = r"""
import logging, torch
from deepinfer.kernels import select, reference
records = []
class Keep(logging.Handler):
    def emit(self, r): records.append(r.getMessage())
logging.getLogger("deepinfer.kernels.select").addHandler(Keep())
torch.manual_seed(0)
x = torch.randn(5, 3, 48).bfloat16()                    # rope_head_dim 24: half 12, not a power of two
cis = torch.polar(torch.ones(5, 12), torch.randn(5, 12))
for _ in range(3):
    assert torch.equal(select.rope(x, cis), reference.rope_ref(x, cis))
q = torch.randn(4, 2, 96).bfloat16()                    # head_dim 96: not a power of two
kv = torch.randn(70, 96).bfloat16()
idx = torch.randint(-1, 70, (4, 64))
sink = torch.randn(2)
for _ in range(2):
    assert torch.equal(select.sparse_attn(q, kv, sink, idx, 0.1), reference.sparse_attn_ref(q, kv, sink, idx, 0.1))
a = torch.randn(7, 48).bfloat16()                       # act_quant over 48 with block 32
try:
    select.act_quant(a)
except Exception:
    pass
print(records)
assert sorted(op for op, _ in select.declined()) == ["act_quant", "rope", "sparse_attn"], select.declined()
assert len(records) == 3 and all("declines the fast path" in r for r in records), records
print("ok")
"""


def test_declines_are_logged_once_and_fall_back():
    env = dict(os.environ, TRITON_INTERPRET="1", DEEPINFER_KERNELS="fast")
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]
