"""recipe_preprocess: API request (or text_input) -> prompt ids, sampling JSON, context, request key.

Plumbing only; the logic is deepinfer.recipe (Preprocessor, prepare_inputs).
"""

import json
from pathlib import Path

import triton_python_backend_utils as pb_utils

from deepinfer import host_gc
from deepinfer.ensemble import config, contract, triton_io
from deepinfer.model.vision.preprocess import checkpoint_image_preparer
from deepinfer.recipe import TEXT_API, Preprocessor, prepare_inputs, preprocess_outputs
from deepinfer.recipe.images import ImageLimits
from deepinfer.recipe.validation import Limits

MODEL = contract.PREPROCESS


class TritonPythonModel:
    def initialize(self, args):
        params = config.model_parameters(json.loads(args["model_config"]))
        checkpoint = Path(config.resolve_checkpoint(params.get("checkpoint", "")))
        max_model_len = params.get("max_model_len") or _max_position(checkpoint)
        limits = ImageLimits(allow_image_urls=params.get("allow_image_urls", "false").lower() == "true",
                             max_images=int(params.get("max_images_per_request") or 16))
        self.pre = Preprocessor(checkpoint / "tokenizer.json", int(max_model_len),
                                limits=Limits.from_json(params.get("limits")),
                                prepare_image=checkpoint_image_preparer(checkpoint), image_limits=limits)
        host_gc.freeze_startup_heap()     # the tokenizer built: later collections skip its objects

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                prepared = prepare_inputs(self.pre, triton_io.read_inputs(pb_utils, request, MODEL))
                if prepared.rejected and prepared.context.api == TEXT_API:
                    # TensorRT-LLM style inputs have no status output: Triton's own 400 (INVALID_ARG)
                    responses.append(triton_io.error_response(pb_utils, prepared.context.error_body, "INVALID_ARG"))
                    continue
                responses.append(triton_io.make_response(pb_utils, MODEL, preprocess_outputs(prepared)))
            except Exception as e:  # noqa: BLE001 - a bug here must fail one request, not the model
                responses.append(triton_io.error_response(pb_utils, f"preprocess: {type(e).__name__}: {e}"))
        return responses


def _max_position(checkpoint: Path) -> int:
    cfg = json.loads((checkpoint / "config.json").read_text())
    return int(cfg.get("text_config", cfg)["max_position_embeddings"])
