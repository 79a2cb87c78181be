"""The logic of the recipe pre- and postprocess models, on the official deepseek-recipe 0.2.0 package.

Leaf package: no torch, no imports from deepinfer or deepinfer.ensemble.
"""

from .context import API_KINDS, TEXT_API, PreparedRequest, RequestContext
from .errors import RecipeError, api_error, error_body
from .postprocess import Postprocessor, ResponseStream, StepOutput, answer_text
from .preprocess import MODEL_NAMES, Preprocessor, conversion_options, prepare_inputs, preprocess_outputs

__all__ = ["API_KINDS", "TEXT_API", "MODEL_NAMES", "Postprocessor", "PreparedRequest", "Preprocessor", "RecipeError",
           "RequestContext", "ResponseStream", "StepOutput", "answer_text", "api_error",
           "conversion_options", "error_body", "prepare_inputs", "preprocess_outputs"]
