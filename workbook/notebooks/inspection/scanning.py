"""Notebook 01's one pass over the task's source - the whole of it, a declared prefix or a seeded
sample - gathering every statistic as the examples stream by. Memory grows with the data only
by the hash indexes (9 bytes per example id, per distinct input and per group); the first
`keep` examples of each split are kept whole for the views and the probes, and figures are
histograms and running sums, exact over everything scanned."""

from __future__ import annotations

import gc
import pickle
import random
import time
from collections import deque
from itertools import islice
from typing import Any, Callable

import pandas as pd

from ...base.errors import WorkbookError, reason
from ...base.forked import ForkedWorkers, cores, fork_available
from ...base.progress import progress_bar
from ...contract.data import Item
from ...contract.hash_index import HashIndex
from ...contract.sources import SPLITS, Checks, length, opened
from ...contract.task import Task
from .scan_block import Block, Part, Tally, merge_part
from .scan_tally import BITS, CHUNK, FINDINGS, Scan

KEEP = 4096  # examples of each split kept whole: the samples' splits fit, so they see them all
WAITING = 65_536  # label ranges held for the probe at most (then it runs on what is kept)
# a source without a length is scanned this far at most when no scan_limit is given: an endless
# stream stops here, and the page says so
UNSIZED_MOST = 10_000_000
BLOCK = 4 * CHUNK  # examples read before they are counted, here or by a worker
# workers are forked once this many examples are read (at once when the source says it has
# more), so a small task scans in one process
FORK_FROM = 2 * BLOCK
MOST_WORKERS = 7
GC_EVERY = 100_000  # allocations between the collector's youngest runs during the pass
IN_FLIGHT = 2  # blocks out per worker; past that, this process counts the next one itself
_END = object()
__all__ = ["BITS", "KEEP", "Scan", "coverage_table", "scan", "scan_workers"]


def scan_workers(asked: int = -1) -> int:
    """The worker processes a scan forks: `asked`, or for -1 one per core this process may use
    besides its own (at most 7) - none on one core or where processes cannot be forked (not
    Linux)."""
    if isinstance(asked, bool) or not isinstance(asked, int) or asked < -1:
        raise WorkbookError(f"scan_workers={asked!r}: a count of worker processes (0: none, -1: "
                            "one per core besides the reading one)",
                            "give scan_workers as an integer >= -1")
    if asked > cores():
        raise WorkbookError(f"scan_workers={asked}: more workers than the {cores()} cores this "
                            "process may use only take turns on them (and each holds a copy of "
                            "what it touches)", f"give scan_workers <= {cores()}, or -1")
    if not fork_available():
        return 0
    return min(cores() - 1, MOST_WORKERS) if asked == -1 else asked


class _Blocks:
    """The reader's side of the pass: blocks counted by forked workers once the source proves
    large, and in this process whenever they have enough to do (so every core counts, this one
    between reads); the parts merged in the order the blocks were read, and the model probed
    once the kept train examples are in."""

    def __init__(self, result: Scan, checks: Checks, keep: int,
                 probe: Callable[[dict[str, list[Item]]], int | None] | None):
        self.result, self.checks, self.keep, self.probe = result, checks, keep, probe
        self.probed = probe is None
        self.tally = Tally(result.task)
        self.pool: ForkedWorkers | None = None
        self.order: deque[tuple[list, Part | None]] = deque()  # None: a worker's, still out

    def fork(self, workers: int) -> None:
        self.pool = ForkedWorkers(
            Tally(self.result.task, portable=True), workers, what="notebook 01's scan",
            fix="scan in one process with scan_workers=0, or with fewer workers "
                "(scan_workers=N) where memory is short")
        self.result.workers = workers

    def send(self, examples: list, positions: list[int]) -> None:
        if not examples:
            return
        result, pool = self.result, self.pool
        block = Block(examples, positions, {n: self.keep - len(result.kept[n]) for n in SPLITS},
                      result.probed, result.outputs)
        if pool is not None and pool.in_flight < IN_FLIGHT * len(pool):
            try:
                pool.put(block)
            except (TypeError, AttributeError, ValueError, pickle.PicklingError) as exc:
                raise WorkbookError(
                    f"the raw examples at positions {positions[0]}-{positions[-1]} cannot be "
                    f"sent to notebook 01's scan workers: {reason(exc)}", "scan in one process "
                    "with scan_workers=0, or yield examples of plain values (str, numbers, "
                    "lists, arrays)") from exc
            self.order.append((examples, None))
        else:
            start = time.monotonic()
            self.order.append((examples, self.tally(block)))
            if pool is not None:  # a worker is stuck past ten times the slowest block here
                pool.wait_s = max(pool.wait_s, 10 * (time.monotonic() - start))
        self._merge(wait=False)

    def _merge(self, wait: bool) -> None:
        """Merge the parts at the head of the order that are in (`wait`: all of them)."""
        result, kept, order, pool = self.result, self.result.kept, self.order, self.pool
        while order and (order[0][1] is not None or wait or pool.ready()):
            examples, part = order.popleft()
            if part is None:
                part = pool.take()[1]
            merge_part(result, self.checks, examples, part, self.keep)
            # the probe, once the kept train examples are in - or earlier, with those there
            # are, before the label ids waiting for it pile up (train late in the stream)
            if not self.probed and kept["train"] and (
                    len(kept["train"]) >= self.keep or result.held > WAITING):
                result.note_outputs(self.probe(kept))
                self.probed = True

    def finish(self) -> None:
        self._merge(wait=True)
        if self.pool is not None:
            self.pool.close()


def scan(task: Task, limit: int = 0, sample: float = 0.0, seed: int = 0,
         keep: int | None = None, probe: Any = None, progress: bool = False,
         workers: int = -1) -> Scan:
    """One pass: every example checked, split, encoded and counted; `limit` stops after that
    many examples, `sample` keeps each with that probability (seeded). `probe(kept)` returns
    the model's output size once the train split's kept examples are in (or the stream
    ended), so label ids are checked against it without a second pass. On a large source,
    `workers` forked processes (`scan_workers`) check, encode and count while this one reads."""
    if sample and not 0 < sample <= 1 or limit < 0:
        raise WorkbookError(f"scan_limit={limit}, scan_sample={sample}: the limit is a count of "
                            "examples (0: all) and the sample a share in (0, 1] (0: every one)",
                            "give scan_limit >= 0 and 0 <= scan_sample <= 1")
    workers = scan_workers(workers)
    said = "the whole source" if not limit and not sample else \
        (f"a seeded sample of {sample:.0%}" if sample else "") + \
        (" of " if sample and limit else "") + (f"the first {limit:,} examples" if limit else "")
    result = Scan(task, said)
    result.groups = HashIndex(lambda group, prior, bit: _crossing(result.crossing_groups, group,
                                                                  prior, bit))
    result.inputs = HashIndex(lambda where, prior, bit: _crossing(result.crossing_inputs, where,
                                                                  prior, bit))
    checks = Checks(task)
    blocks = _Blocks(result, checks, KEEP if keep is None else keep, probe)
    source, origin = opened(task)
    total = length(origin)
    draw = random.Random(seed)
    bar = progress_bar(total=min(limit, total) if limit and total else limit or total,
                       desc="scanned", unit="examples", disable=not progress)
    seen = 0
    cap = limit or (UNSIZED_MOST if total is None else 0)
    sizes = [n for n in (limit, total) if n]
    fork_at = 0 if not workers else 1 if sizes and min(sizes) > FORK_FROM else FORK_FROM
    examples: list = []  # drawn, not yet sent
    positions: list[int] = []
    thresholds = gc.get_threshold()
    # the pass makes and drops a few objects per example, none in a cycle: the collector's
    # frequent runs over everything alive (the model, the kernel's history) cost a tenth of it
    gc.set_threshold(max(thresholds[0], GC_EVERY), *thresholds[1:])
    try:
        while True:  # read a block of rows at a time, sent on in blocks of those drawn
            want = min(BLOCK, cap - seen) if cap else BLOCK
            if not want:
                if not limit and next(source, _END) is not _END:  # no length, not ended
                    result.scanned = (f"the first {cap:,} examples (the source has no length "
                                      "and had not ended there: scan_limit scans more or "
                                      "fewer)")
                break
            rows = list(islice(source, want))
            start, seen = seen, seen + len(rows)
            bar.update(len(rows))
            if sample:
                drawn = [i for i in range(len(rows)) if draw.random() < sample]
                examples += [rows[i] for i in drawn]
                positions += [start + i for i in drawn]
            else:
                examples += rows
                positions += range(start, seen)
            while len(examples) >= BLOCK:
                if blocks.pool is None and 0 < fork_at <= seen:
                    blocks.fork(workers)
                blocks.send(examples[:BLOCK], positions[:BLOCK])
                examples, positions = examples[BLOCK:], positions[BLOCK:]
            if len(rows) < want:
                break
        blocks.send(examples, positions)
        blocks.finish()
    finally:
        gc.set_threshold(*thresholds)
        bar.close()
        if blocks.pool is not None:
            blocks.pool.close(abort=True)  # nothing when finished; on an error, at once
    if sample and seen and not checks.read:
        raise WorkbookError(f"scan_sample={sample} drew none of the {seen} examples read",
                            "raise scan_sample, or give scan_limit instead")
    checks.raise_any()
    if not blocks.probed:
        result.note_outputs(probe(result.kept))
    result.probed = True
    result.groups.flush()
    result.inputs.flush()
    for name in ("train", "validation"):
        if not result.examples[name]:
            raise WorkbookError(
                f"the {name} split of task {task.name!r} is empty in {result.scanned} "
                f"({sum(result.examples.values())} examples scanned)",
                "add examples or groups, or change split_fractions" +
                (", or scan more of the source (scan_limit, scan_sample)"
                 if limit or sample else ""))
    return result


def _crossing(found: list, what: Any, prior: int, bit: int) -> None:
    if prior & ~bit and len(found) < FINDINGS and what not in found:
        found.append(what)


def coverage_table(result: Scan) -> pd.DataFrame:
    """How many examples of each split contribute how many targets (the histogram's data)."""
    rows = [{"split": name, "targets": t, "examples": n}
            for name in SPLITS for t, n in sorted(result.targets_hist[name].items())]
    return pd.DataFrame(rows, columns=["split", "targets", "examples"])

