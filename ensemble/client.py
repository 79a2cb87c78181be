"""Client helpers for the deepseek_v41_flash ensemble: gRPC streaming and HTTP generate(_stream).

    from deepinfer.ensemble.client import GrpcClient, generate_stream
    with GrpcClient("localhost:8001") as client:
        for out in client.stream({"request": json.dumps(body), "api": "chat.completions"}):
            for chunk in out["response"]: print(chunk)       # chunk / event JSON, SSE-ready

Each yielded `out` holds the ensemble's outputs by contract name, decoded to Python values. A
response whose `status` is not 200 carries the API's error body as its only `response` element.
"""

from __future__ import annotations

import json
import queue
import uuid
from typing import Iterator

import numpy as np

from . import contract as c

_TIMEOUT_S = 300.0


def _input_tensor(grpcclient, t: c.Tensor, value):
    if t.dims == (-1,):
        values = list(value)
    else:
        values = [value]
    if t.dtype == c.BYTES:
        arr = np.array([v.encode() if isinstance(v, str) else v for v in values], dtype=np.object_)
    else:
        arr = np.array(values, dtype=c.NUMPY[t.dtype])
    tensor = grpcclient.InferInput(t.name, list(arr.shape), t.dtype.replace("TYPE_", "").replace("STRING", "BYTES"))
    tensor.set_data_from_numpy(arr)
    return tensor


def decode_result(result, model: str = c.ENSEMBLE) -> dict:
    """An InferResult -> {output name: value} by the contract (BYTES [1] -> str, [-1] -> list)."""
    outs = c.ensemble_outputs() if model == c.ENSEMBLE else c.tensors(model, c.OUT)
    values = {}
    for t in outs:
        arr = result.as_numpy(t.name)
        if arr is None:
            continue
        flat = arr.reshape(-1)
        if t.dtype == c.BYTES:
            items = [x.decode() if isinstance(x, bytes) else str(x) for x in flat]
            values[t.name] = items if t.dims == (-1,) else (items[0] if items else "")
        else:
            values[t.name] = flat.tolist() if t.dims == (-1,) else (flat[0].item() if flat.size else None)
    return values


class GrpcClient:
    """One gRPC stream; requests run one at a time per client (use one client per concurrent stream)."""

    def __init__(self, url: str = "localhost:8001", model: str = c.ENSEMBLE):
        import tritonclient.grpc as grpcclient
        self._grpc = grpcclient
        self.model = model
        self.client = grpcclient.InferenceServerClient(url)
        self._responses: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self._responses.put((result, error)))

    def stream(self, inputs: dict, request_id: str | None = None, timeout: float = _TIMEOUT_S) -> Iterator[dict]:
        """Send one request; yield its decoded responses until the final one. Raises on a Triton error."""
        specs = {t.name: t for t in (c.ensemble_inputs() if self.model == c.ENSEMBLE else c.tensors(self.model, c.IN))}
        tensors = [_input_tensor(self._grpc, specs[k], v) for k, v in inputs.items() if v is not None]
        self.client.async_stream_infer(self.model, tensors, request_id=request_id or uuid.uuid4().hex,
                                       enable_empty_final_response=True)
        while True:
            result, error = self._responses.get(timeout=timeout)
            if error is not None:
                raise TritonStreamError(str(error))
            response = result.get_response()
            final = response.parameters.get("triton_final_response")
            if response.outputs:
                yield decode_result(result, self.model)
            if final is not None and final.bool_param:
                return

    def close(self) -> None:
        self.client.stop_stream()
        self.client.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class TritonStreamError(RuntimeError):
    pass


def api_inputs(api: str, body: dict | str) -> dict:
    return {"request": body if isinstance(body, str) else json.dumps(body), "api": api}


def generate_stream(base_url: str, payload: dict, model: str = c.ENSEMBLE, timeout: float = _TIMEOUT_S) -> Iterator[dict]:
    """POST v2/models/<model>/generate_stream; yields each SSE `data:` event as a dict."""
    import httpx
    with httpx.stream("POST", f"{base_url}/v2/models/{model}/generate_stream", json=payload, timeout=timeout) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                yield json.loads(line[5:])


def generate(base_url: str, payload: dict, model: str = c.ENSEMBLE, timeout: float = _TIMEOUT_S) -> dict:
    """POST v2/models/<model>/generate (a non-streaming request: exactly one response)."""
    import httpx
    r = httpx.post(f"{base_url}/v2/models/{model}/generate", json=payload, timeout=timeout)
    return {"http_status": r.status_code, **r.json()}
