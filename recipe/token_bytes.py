"""The UTF-8 bytes behind byte-level BPE token ids, to tell when a response ends inside a character.

deepseek-recipe holds back the ids of an incomplete multi-byte character and drops them, uncounted,
when the response finishes (a request cut by max_tokens mid-character); the postprocess counts them
back in so that usage equals the engine's token count.
"""

from __future__ import annotations

import json
from pathlib import Path


def _byte_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in character for each byte (the GPT-2 mapping)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class TokenBytes:
    def __init__(self, vocab: dict[str, int], special_ids: set[int]):
        alphabet = _byte_alphabet()
        self._bytes: dict[int, bytes] = {}
        for token, i in vocab.items():
            if i not in special_ids and all(c in alphabet for c in token):
                self._bytes[i] = bytes(alphabet[c] for c in token)

    @classmethod
    def from_file(cls, tokenizer_json: str | Path) -> "TokenBytes":
        data = json.loads(Path(tokenizer_json).read_text(encoding="utf-8"))
        special = {t["id"] for t in data.get("added_tokens", [])}
        return cls(data["model"]["vocab"], special)

    def incomplete_tail(self, ids: list[int]) -> int:
        """How many trailing ids only carry the start of a UTF-8 character that never completes."""
        tail, owners = b"", []
        for k, i in enumerate(reversed(ids[-4:])):     # a character is at most 4 bytes
            piece = self._bytes.get(i)
            if piece is None:
                break
            tail = piece + tail
            owners = [k] * len(piece) + owners
        # walk back over continuation bytes (10xxxxxx) to the lead byte of the last character
        n = 0
        while n < len(tail) and n < 4 and tail[-1 - n] & 0xC0 == 0x80:
            n += 1
        if n == len(tail):
            return 0                                    # no lead byte in view
        lead = tail[-1 - n]
        need = 2 if lead >> 5 == 0b110 else 3 if lead >> 4 == 0b1110 else 4 if lead >> 3 == 0b11110 else 1
        if n + 1 >= need:
            return 0                                    # the last character is complete
        return owners[-1 - n] + 1                       # the ids from the one holding the lead byte
