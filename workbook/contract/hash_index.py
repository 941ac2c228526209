"""Which splits a key (an example id, a group, an input) was seen in, for a stream of any
length: 8 bytes of hash and one byte of split mask per distinct key, kept sorted and merged a
block at a time - no Python object per key. Keys are Python's own 64-bit hashes (of a string or
of bytes): within one process two different keys share one with probability about n^2 / 2^65."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

BLOCK = 1 << 16


def key_of(value: str | bytes) -> int:
    return hash(value) & 0xFFFF_FFFF_FFFF_FFFF


class HashIndex:
    """`add(key, bit, payload)` records a key seen in a split (`bit`); each time a key arrives
    that was seen before, `on_repeat(payload, prior_mask, bit)` is called - at the latest
    when its block is merged (`flush`). `masks` then tells, per distinct key, the splits."""

    def __init__(self, on_repeat: Callable[[Any, int, int], None]):
        self.keys = np.empty(0, np.uint64)
        self.masks = np.empty(0, np.uint8)
        self.on_repeat = on_repeat
        self._keys: list[int] = []
        self._bits: list[int] = []
        self._payloads: list[Any] = []

    def add(self, key: int, bit: int, payload: Any) -> None:
        self._keys.append(key)
        self._bits.append(bit)
        self._payloads.append(payload)
        if len(self._keys) >= BLOCK:
            self.flush()

    def flush(self) -> None:
        """Merge the pending block: report its repeats, then fold it into the sorted keys."""
        if not self._keys:
            return
        keys = np.array(self._keys, dtype=np.uint64)
        bits = np.array(self._bits, dtype=np.uint8)
        prior = np.zeros(len(keys), np.uint8)
        if len(self.keys):
            at = np.minimum(np.searchsorted(self.keys, keys), len(self.keys) - 1)
            found = self.keys[at] == keys
            prior[found] = self.masks[at[found]]
        prior |= _earlier_in_block(keys, bits)
        for i in np.flatnonzero(prior):
            self.on_repeat(self._payloads[i], int(prior[i]), int(bits[i]))
        order = np.argsort(keys, kind="stable")
        keys, bits = keys[order], bits[order]
        starts = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]])
        keys, bits = keys[starts], np.bitwise_or.reduceat(bits, starts)
        if len(self.keys):  # fold the block in: one new array, never a sort of the whole
            at = np.searchsorted(self.keys, keys)
            hit = self.keys[np.minimum(at, len(self.keys) - 1)] == keys
            self.masks[at[hit]] |= bits[hit]
            self.keys = np.insert(self.keys, at[~hit], keys[~hit])
            self.masks = np.insert(self.masks, at[~hit], bits[~hit])
        else:
            self.keys, self.masks = keys, bits
        self._keys, self._bits, self._payloads = [], [], []

    def count(self, bit: int | None = None, crossing: bool = False) -> int:
        """Distinct keys seen in split `bit` (None: any), or seen in more than one split."""
        self.flush()
        if crossing:
            return int(((self.masks & (self.masks - 1)) != 0).sum())  # two bits or more
        return len(self.masks) if bit is None else int(((self.masks & bit) > 0).sum())


def _earlier_in_block(keys: np.ndarray, bits: np.ndarray) -> np.ndarray:
    """Per entry, the splits its key had at entries before it in the same block."""
    order = np.lexsort((np.arange(len(keys)), keys))
    sorted_keys, sorted_bits = keys[order], bits[order].astype(np.int64)
    first = np.r_[True, sorted_keys[1:] != sorted_keys[:-1]]
    group = np.cumsum(first) - 1
    earlier = np.zeros(len(keys), np.uint8)
    for k in range(8):
        bit = (sorted_bits >> k) & 1
        total = np.cumsum(bit)
        before = total - bit - (total - bit)[first][group]
        earlier |= ((before > 0).astype(np.uint8) << k)
    out = np.empty_like(earlier)
    out[order] = earlier
    return out
