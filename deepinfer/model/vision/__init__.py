"""The V4.1 vision path: images -> span embeddings the backbone reads like token embeddings.

    config.py      VisionArgs, from the HF `vision_config` (None = a text-only checkpoint)
    preprocess.py  image bytes -> ImageInput (plan, patches), the reference's image_processor.py
    spans.py       prompt placeholders -> image spans (token ids + token types), ImagePrompt
    vit.py         the ViT (patch embed, 2D RoPE, pre-norm blocks), many images in one pass
    aligner.py     3x3 unfold + GELU MLP into the LLM width
    tower.py       VisionTower: ViT + aligner + image_start/end/newline; encode(images) -> spans

The backbone's part (model/transformer.py, moe.py, engram.py): span rows overwrite the embeddings
before the hc expansion, span tokens route with gate.bias_vl and are DEAD for Engram. The engine's
part: requests carry an ImagePrompt (engine.py), the scheduler never cuts a span
(Request.clip_to_spans), each request's images are encoded once, batched over the requests added
since the last step, on a side CUDA stream ahead of scheduling (worker/image_embeds.py ImageEncoder;
the request is admitted once they are ready), and the runner merges them (ImageEmbeds).
"""

from .config import VisionArgs
from .preprocess import (IMAGE, IMAGE_END, IMAGE_NEW_LINE, IMAGE_START, TEXT, ImageError, ImageInput, ImagePlan,
                         decode_image, image_from_pixels, load_image, num_image_tokens, padded_rgb, plan_image, prepare_pixels)
from .spans import ImagePrompt, expand_image_placeholders
from .tower import VisionTower

__all__ = ["IMAGE", "IMAGE_END", "IMAGE_NEW_LINE", "IMAGE_START", "TEXT", "ImageError", "ImageInput", "ImagePlan",
           "ImagePrompt", "VisionArgs", "VisionTower", "decode_image", "expand_image_placeholders", "image_from_pixels",
           "load_image", "num_image_tokens", "padded_rgb", "plan_image", "prepare_pixels"]
