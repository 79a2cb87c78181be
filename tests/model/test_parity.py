"""deepinfer-score --teacher-force --dump-hidden on the shared fixtures passes check-parity
--require-hidden (the fixture's pass rule: logits, top-1, Engram hash ids, DSpark drafts, hidden)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest


@pytest.mark.parametrize("name", ["v41-tiny", "v41-tiny-bf16"])
def test_score_passes_fixture_rule(fixture_dir, shared_dir, tmp_path, name):
    from deepinfer.cli.score import main

    fx = fixture_dir(name)
    out = tmp_path / "cand.npz"
    rc = main(["--checkpoint", str(fx), "--prompts", str(fx / "prompts.json"), "--decode-steps", "16",
               "--teacher-force", str(fx / "expected.npz"), "--dump-hidden", "--out", str(out)])
    assert rc == 0
    cand = np.load(out)
    for key in ("p0_draft_tokens", "p0_draft_confidence", "p0_draft_logits", "p0_hidden", "p0_engram_hash_ids"):
        assert key in cand, key
    res = subprocess.run([sys.executable, str(shared_dir / "tools" / "check-parity"), str(fx), str(out),
                          "--require-hidden"], capture_output=True, text=True)
    last = res.stdout.strip().splitlines()[-1]
    print(res.stdout[-3000:])
    assert res.returncode == 0, last
    assert "parity=PASS" in last and "hidden=pass" in last
    assert "draft-token agreement" in res.stdout
