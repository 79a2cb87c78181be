"""The tiny checkpoint the serving tests run: `python -m deepinfer.cli.make_checkpoint --preset tiny`
(what `make serve` uses) when it exists, else the shared v41-tiny-bf16 fixture built by make-fixture."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared" if (REPO.parent / "shared").exists() else Path("/work/shared")


def build_tiny_checkpoint(out: Path) -> Path | None:
    if importlib.util.find_spec("deepinfer.cli.make_checkpoint") is not None:
        subprocess.run([sys.executable, "-m", "deepinfer.cli.make_checkpoint", "--preset", "tiny", "--seed", "0",
                        "--out", str(out)], check=True, capture_output=True)
        return out
    tool, src = SHARED / "tools" / "make-fixture", SHARED / "fixtures" / "v41-tiny-bf16"
    if tool.exists() and src.exists():
        subprocess.run([sys.executable, str(tool), "--from-fixture", str(src), "--out", str(out)],
                       check=True, capture_output=True)
        return out
    return None
