"""Random-weight checkpoints in the V4.1 release format, and the V4.1 tokenizer.json builder."""

from .generator import PRESETS, make_checkpoint  # noqa: F401
from .tokenizer import write_tokenizer  # noqa: F401
