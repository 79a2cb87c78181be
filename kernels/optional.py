"""Optional kernel libraries, imported under their own names first, then the copies bundled in other
wheels (DESIGN.md, GPUs). A missing package or a CUDA-less machine just means None."""

from __future__ import annotations

import functools
import importlib


@functools.cache
def first_importable(*names: str):
    """The first of `names` that imports, or None (tried once per process)."""
    for name in names:
        try:
            return importlib.import_module(name)
        except Exception:  # noqa: BLE001 - ImportError, or a library failing to find CUDA at import
            continue
    return None
