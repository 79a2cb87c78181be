"""The whole model on the shared fixtures with the fast ops bound in deepinfer.model.ops (the
wiring kernels/select.py proposes), teacher-forced through deepinfer-score on CUDA, judged by
check-parity with the fixture's own rule."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]
SHARED = Path(os.environ.get("DEEPINFER_SHARED", REPO / ".." / "shared")).resolve()


@pytest.mark.parametrize("name", ["v41-tiny-bf16", "v41-tiny"])
def test_fixture_parity_with_fast_ops(name, tmp_path, monkeypatch):
    if not (SHARED / "fixtures" / name / "recipe.json").is_file():
        pytest.skip(f"shared fixtures not found at {SHARED}")
    from deepinfer.cli.score import main
    from deepinfer.kernels import select
    from deepinfer.model import ops
    for op in ("act_quant", "fp4_quant", "sparse_attn", "hc_split_sinkhorn"):
        monkeypatch.setattr(ops, op, getattr(select, op))
    fx = tmp_path / name
    subprocess.run([sys.executable, str(SHARED / "tools" / "make-fixture"), "--from-fixture",
                    str(SHARED / "fixtures" / name), "--out", str(fx)], check=True, capture_output=True)
    out = tmp_path / "cand.npz"
    rc = main(["--checkpoint", str(fx), "--prompts", str(fx / "prompts.json"), "--decode-steps", "16",
               "--teacher-force", str(fx / "expected.npz"), "--out", str(out), "--device", "cuda"])
    assert rc == 0
    res = subprocess.run([sys.executable, str(SHARED / "tools" / "check-parity"), str(fx), str(out)],
                         capture_output=True, text=True)
    print(res.stdout[-3000:])
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
