"""Triton tensors <-> plain Python values, by the contract table (no logic, no triton import).

model.py files pass their `triton_python_backend_utils` module in, so this stays importable (and
testable) without Triton.
"""

from __future__ import annotations

import numpy as np

from . import contract as c


def read_inputs(pb_utils, request, model: str) -> dict:
    """Input tensors of one request as Python values: str for [1] BYTES, list for [-1], scalars for
    [1]; None for an absent optional input."""
    values = {}
    for t in c.tensors(model, c.IN):
        tensor = pb_utils.get_input_tensor_by_name(request, t.name)
        values[t.name] = None if tensor is None else to_python(t, tensor.as_numpy())
    return values


def _text(x) -> str | bytes:
    """NOTE: bytes that are not UTF-8 stay bytes, so the preprocess can refuse them (a 400) instead
    of running on U+FFFD replacements."""
    if not isinstance(x, bytes):
        return str(x)
    try:
        return x.decode("utf-8")
    except UnicodeDecodeError:
        return x


def to_python(t: c.Tensor, array: np.ndarray):
    flat = array.reshape(-1)
    if t.dtype == c.BYTES:
        items = [_text(x) for x in flat]
        return items if t.dims == (-1,) else (items[0] if items else None)
    if t.dtype == c.UINT8:
        return flat                          # raw bytes (image pixels): kept as an array
    if t.dims == (-1,):
        return flat.tolist()
    return flat[0].item() if flat.size else None


def to_numpy(t: c.Tensor, value) -> np.ndarray:
    if isinstance(value, np.ndarray) and t.dtype != c.BYTES:
        return np.ascontiguousarray(value, dtype=c.NUMPY[t.dtype]).reshape(-1 if t.dims == (-1,) else 1)
    if t.dims == (-1,):
        items = list(value)
        if t.dtype == c.BYTES:
            return np.array([s.encode("utf-8") if isinstance(s, str) else s for s in items], dtype=np.object_)
        return np.array(items, dtype=c.NUMPY[t.dtype])
    if t.dtype == c.BYTES:
        return np.array([value.encode("utf-8") if isinstance(value, str) else value], dtype=np.object_)
    return np.array([value], dtype=c.NUMPY[t.dtype])


def make_response(pb_utils, model: str, values: dict):
    """An InferenceResponse with every output of `model` (the contract: all present, always)."""
    tensors = [pb_utils.Tensor(t.name, to_numpy(t, values[t.name])) for t in c.tensors(model, c.OUT)]
    return pb_utils.InferenceResponse(output_tensors=tensors)


def error_response(pb_utils, message: str, code: str = "INTERNAL"):
    """A Triton error response; code names a pb_utils.TritonError constant."""
    err_code = getattr(pb_utils.TritonError, code, pb_utils.TritonError.INTERNAL)
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, err_code))


def io_config(model: str) -> tuple[list[dict], list[dict]]:
    """auto_complete_config entries of a composing model."""
    def entry(t):
        d = {"name": t.name, "data_type": t.dtype, "dims": list(t.dims)}
        if t.optional and t.io == c.IN:
            d["optional"] = True
        return d
    return [entry(t) for t in c.tensors(model, c.IN)], [entry(t) for t in c.tensors(model, c.OUT)]
