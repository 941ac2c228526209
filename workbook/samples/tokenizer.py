"""A byte-level tokenizer: every UTF-8 byte is a token, plus padding, start and end markers."""

from __future__ import annotations

from typing import Sequence

PAD, BOS, EOS = 256, 257, 258
VOCAB_SIZE = 259
_SPECIAL = {PAD: "<pad>", BOS: "<s>", EOS: "</s>"}


def encode(text: str) -> list[int]:
    """Text -> byte ids (no markers)."""
    return list(text.encode("utf-8"))


def decode(ids: Sequence[int], keep_special: bool = False) -> str:
    """Byte ids -> text; markers are dropped unless `keep_special`."""
    out, raw = [], bytearray()
    for i in map(int, ids):
        if i < 256:
            raw.append(i)
            continue
        out.append(raw.decode("utf-8", errors="replace"))
        raw = bytearray()
        if keep_special:
            out.append(_SPECIAL.get(i, f"<{i}>"))
    out.append(raw.decode("utf-8", errors="replace"))
    return "".join(out)

