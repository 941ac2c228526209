"""Which splits a key (an example id, a group, an input) was seen in, for a stream of any
length: 8 bytes of hash and one byte of split mask per distinct key - no Python object per key.
Keys wait in a block; a full block is looked up in sorted runs of earlier keys and its new keys
become a run, runs of like size merged (as in an LSM tree), so each key is merged about log2(n)
times in all. Keys are Python's own 64-bit hashes (of a string or of bytes): within one process
two different keys share one with probability about n^2 / 2^65."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

BLOCK = 1 << 16


def key_of(value: str | bytes) -> int:
    return hash(value) & 0xFFFF_FFFF_FFFF_FFFF


def keys_of(values: Sequence[str | bytes]) -> np.ndarray:
    """`key_of` of many values at once, as uint64."""
    return np.fromiter(map(hash, values), np.int64, len(values)).view(np.uint64)


class HashIndex:
    """`add(key, bit, payload)` (or `add_many`) records a key seen in a split (`bit`); each time
    a key arrives that was seen before, `on_repeat(payload, prior_mask, bit)` is called, in the
    order the keys came - at the latest when its block is merged (`flush`). `count` then tells
    the distinct keys of a split, or those in two splits."""

    def __init__(self, on_repeat: Callable[[Any, int, int], None]):
        self.on_repeat = on_repeat
        self._runs: list[tuple[np.ndarray, np.ndarray]] = []  # sorted, disjoint; each >= 2x next
        self._blocks: list[tuple[np.ndarray, np.ndarray, Sequence]] = []  # waiting, in order
        self._waiting = 0
        self._keys: list[int] = []
        self._bits: list[int] = []
        self._payloads: list[Any] = []

    def add(self, key: int, bit: int, payload: Any) -> None:
        self._keys.append(key)
        self._bits.append(bit)
        self._payloads.append(payload)
        if self._waiting + len(self._keys) >= BLOCK:
            self.flush()

    def add_many(self, keys: np.ndarray, bits: int | np.ndarray, payloads: Sequence) -> None:
        """Many keys at once (uint64), one split bit for all or one each; `payloads[i]` is
        read only for a repeat."""
        if not len(keys):
            return
        self._stage()
        self._blocks.append((np.asarray(keys, np.uint64),
                             np.broadcast_to(np.asarray(bits, np.uint8), (len(keys),)), payloads))
        self._waiting += len(keys)
        if self._waiting >= BLOCK:
            self.flush()

    def _stage(self) -> None:
        if self._keys:
            self._blocks.append((np.array(self._keys, np.uint64),
                                 np.array(self._bits, np.uint8), self._payloads))
            self._waiting += len(self._keys)
            self._keys, self._bits, self._payloads = [], [], []

    def flush(self) -> None:
        """Merge the waiting keys: report their repeats, then keep the new ones as a run."""
        self._stage()
        if not self._blocks:
            return
        blocks, self._blocks, self._waiting = self._blocks, [], 0
        keys = np.concatenate([b[0] for b in blocks])
        bits = np.concatenate([b[1] for b in blocks])
        unique, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
        inverse = inverse.reshape(-1)
        joined = np.zeros(len(unique), np.uint8)  # the block's splits per unique key
        np.bitwise_or.at(joined, inverse, bits)
        before = np.zeros(len(unique), np.uint8)  # their splits in earlier blocks
        new = np.ones(len(unique), bool)
        for run_keys, run_masks in self._runs:
            at = np.minimum(np.searchsorted(run_keys, unique), len(run_keys) - 1)
            found = run_keys[at] == unique
            before[found] = run_masks[at[found]]
            run_masks[at[found]] |= joined[found]
            new &= ~found
        prior = before[inverse]
        if len(unique) < len(keys):
            prior |= _earlier_in_block(inverse, first, bits)
        repeats = np.flatnonzero(prior)
        if len(repeats):
            starts = np.cumsum([0] + [len(b[0]) for b in blocks])
            which = np.searchsorted(starts, repeats, side="right") - 1
            for i, b in zip(repeats.tolist(), which.tolist(), strict=True):
                self.on_repeat(blocks[b][2][i - starts[b]], int(prior[i]), int(bits[i]))
        if new.any():
            self._runs.append((unique[new], joined[new]))
        while len(self._runs) > 1 and len(self._runs[-2][0]) < 2 * len(self._runs[-1][0]):
            self._merge_last()

    def _merge_last(self) -> None:
        """Merge the two newest runs (their keys differ): the newer one's keys go where
        searchsorted puts them, the older one's fill the rest - no sort, no index array of the
        whole."""
        (k1, m1), (k2, m2) = self._runs.pop(-2), self._runs.pop()
        at = np.searchsorted(k1, k2) + np.arange(len(k2))
        older = np.ones(len(k1) + len(k2), bool)
        older[at] = False
        keys, masks = np.empty(len(older), np.uint64), np.empty(len(older), np.uint8)
        keys[at], masks[at] = k2, m2
        keys[older], masks[older] = k1, m1
        self._runs.append((keys, masks))

    def _merged(self) -> tuple[np.ndarray, np.ndarray]:
        self.flush()
        while len(self._runs) > 1:
            self._merge_last()
        return self._runs[0] if self._runs else (np.empty(0, np.uint64), np.empty(0, np.uint8))

    @property
    def keys(self) -> np.ndarray:
        return self._merged()[0]

    @property
    def masks(self) -> np.ndarray:
        return self._merged()[1]

    def count(self, bit: int | None = None, crossing: bool = False) -> int:
        """Distinct keys seen in split `bit` (None: any), or seen in more than one split,
        summed over the runs (they share no key: nothing is merged for it)."""
        self.flush()
        if crossing:  # two bits or more
            return sum(int(((m & (m - 1)) != 0).sum()) for _, m in self._runs)
        return sum(len(m) if bit is None else int(((m & bit) > 0).sum()) for _, m in self._runs)


def _earlier_in_block(inverse: np.ndarray, first: np.ndarray, bits: np.ndarray) -> np.ndarray:
    """Per entry, the splits its key had at entries before it in the same block (`inverse`:
    each entry's unique key, `first`: where each unique key first came)."""
    earlier = np.zeros(len(inverse), np.uint8)
    again = np.flatnonzero(first[inverse] != np.arange(len(inverse)))  # not a key's first
    if not len(again):
        return earlier
    keys_again = np.unique(inverse[again])
    mine = np.flatnonzero(np.isin(inverse, keys_again))  # every entry of a repeated key
    order = mine[np.lexsort((mine, inverse[mine]))]
    owner, b = inverse[order], bits[order].astype(np.int64)
    start = np.r_[True, owner[1:] != owner[:-1]]
    group = np.cumsum(start) - 1
    out = np.zeros(len(order), np.uint8)
    for k in range(8):
        bit = (b >> k) & 1
        if not bit.any():
            continue
        total = np.cumsum(bit)
        before = total - bit - (total - bit)[start][group]
        out |= (before > 0).astype(np.uint8) << k
    earlier[order] = out
    return earlier
