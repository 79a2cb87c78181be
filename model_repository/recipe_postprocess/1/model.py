"""recipe_postprocess: engine token ids -> API chunks (SSE-ready JSON) + text delta + usage.

Plumbing only; the logic is deepinfer.recipe.Postprocessor (one StreamProcessor per request key).
One instance (see ensemble/contract.py): every chunk of a request must reach this process in order.
On a matched stop sequence it stops the engine request through the engine's `stop` input (BLS).
"""

import json
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from deepinfer import host_gc
from deepinfer.ensemble import config, contract, triton_io
from deepinfer.recipe import Postprocessor

MODEL = contract.POSTPROCESS


class TritonPythonModel:
    def initialize(self, args):
        params = config.model_parameters(json.loads(args["model_config"]))
        checkpoint = Path(config.resolve_checkpoint(params.get("checkpoint", "")))
        self.post = Postprocessor(checkpoint / "tokenizer.json")
        host_gc.freeze_startup_heap()     # the tokenizer built: later collections skip its objects

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                outputs, stop_engine = self.post.process(triton_io.read_inputs(pb_utils, request, MODEL))
                if stop_engine:
                    _stop_engine(outputs_key(request))
                responses.append(triton_io.make_response(pb_utils, MODEL, outputs))
            except Exception as e:  # noqa: BLE001
                responses.append(triton_io.error_response(pb_utils, f"postprocess: {type(e).__name__}: {e}"))
        return responses


def outputs_key(request) -> str:
    return pb_utils.get_input_tensor_by_name(request, "request_key").as_numpy().reshape(-1)[0].decode()


def _stop_engine(request_key: str) -> None:
    """request_key + stop=true to the engine (TensorRT-LLM convention); it answers with FINAL only."""
    inputs = [pb_utils.Tensor("request_key", np.array([request_key.encode()], dtype=np.object_)),
              pb_utils.Tensor("stop", np.array([True], dtype=bool))]
    stop = pb_utils.InferenceRequest(model_name=contract.ENGINE, requested_output_names=[], inputs=inputs)
    for _ in stop.exec(decoupled=True):
        pass
