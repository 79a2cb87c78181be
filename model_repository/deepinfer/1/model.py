"""deepinfer: the decoupled engine model. Owns one deepinfer.AsyncEngine.

Plumbing only: execute() hands each request to deepinfer.ensemble.engine_driver.EngineDriver and
returns at once; the driver streams one response per engine step and always ends with FINAL.
Parameters: `checkpoint` (folder; "" = $DEEPINFER_CHECKPOINT or <repo>/checkpoints/tiny) and
`engine_args` (JSON of deepinfer.EngineArgs fields).
"""

import json

import triton_python_backend_utils as pb_utils

from deepinfer import AsyncEngine, EngineArgs, OutputConstraint, SamplingParams, host_gc
from deepinfer.ensemble import config, contract, triton_io
from deepinfer.ensemble.engine_driver import EngineDriver, EngineRequest
from deepinfer.ensemble.metrics import TritonMetrics

MODEL = contract.ENGINE
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class _Sender:
    """The driver's Sender on a Triton response sender."""

    def __init__(self, request):
        self.sender = request.get_response_sender()

    def send(self, outputs, final):
        response = None if outputs is None else triton_io.make_response(pb_utils, MODEL, outputs)
        self.sender.send(response, flags=FINAL if final else 0)

    def send_error(self, message, code):
        self.sender.send(triton_io.error_response(pb_utils, message, code), flags=FINAL)

    def is_cancelled(self):
        return self.sender.is_cancelled()


def make_sampling_params(kwargs: dict) -> SamplingParams:
    constraint = kwargs.get("constraint")
    return SamplingParams(**{**kwargs, "constraint": OutputConstraint(**constraint) if constraint else None})


class TritonPythonModel:
    def initialize(self, args):
        params = config.model_parameters(json.loads(args["model_config"]))
        engine_args = json.loads(params.get("engine_args") or "{}")
        checkpoint = config.resolve_checkpoint(params.get("checkpoint", ""))
        self.engine = AsyncEngine(EngineArgs.from_kwargs(checkpoint, **engine_args))
        labels = {"model": args["model_name"], "version": args["model_version"]}
        self.metrics = TritonMetrics(pb_utils, labels, self.engine.stats,
                                     num_ranks=self.engine.engine.args.data_parallel_size)
        self.driver = EngineDriver(self.engine, make_sampling_params, self.metrics)
        host_gc.freeze_startup_heap()     # the engine built: later collections skip its objects

    def execute(self, requests):
        for request in requests:
            sender = _Sender(request)
            try:
                req = EngineRequest.from_inputs(triton_io.read_inputs(pb_utils, request, MODEL))
            except Exception as e:  # noqa: BLE001 - malformed tensors: INVALID_ARG + FINAL
                sender.send_error(f"bad engine request: {e}", "INVALID_ARG")
                continue
            self.driver.submit(req, sender)
        return None

    def finalize(self):
        self.driver.shutdown()
        self.engine.shutdown()
        self.metrics.close()
        host_gc.unfreeze()                # the engine's cycles collectable again (a model unload)
