"""The settings notebook 03's gates run at, the rows and report they produce (one row per
phase, with its remediation), and the input-pipeline judgement of the data gate."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from ...contract.data import Item
from ...contract.task import Task
from ...training.loop import DEFAULT_UPDATES, TrainConfig, UpdateShape
from ...training.predict import Plan
from ...training.workload import TRAINING_PHASES

PHASES = ("data", *TRAINING_PHASES, "checkpoint save", "export", "resume")
REMEDIATION = {
    "data": "fix the dataset or the transform (encode/collate)",
    "forward + loss": "check a reduced batch and its values",
    "backward": "check the graph, the precision and the loss normalisation",
    "update (first)": "check the optimizer (every trainable parameter in it) and accumulation",
    "update (later)": "check the optimizer and accumulation",
    "validation": "separate the evaluation settings (eval mode, no_grad) from training",
    "checkpoint save": "make room (disk, permissions, memory) before the campaign",
    "export": "make room (disk, permissions, memory) before the campaign",
    "resume": "fix the checkpoint (all state saved and restored) before any series",
}
# The data gate calls a loop input-bound only when the median wait for data per update is
# above both a share of the update and this absolute floor. The wait is CPU work (reading,
# decoding, collating) that the rental pays as it is measured here, while its GPU makes the update
# faster: the share measured here understates the rental's, so the share alone misjudges both
# ways - and for a sub-millisecond update on a shared CPU it is timer and scheduler noise (one
# time slice is a few ms). Below 5 ms per update the loader is not what a rented GPU waits on:
# an update of a model worth renting for takes tens of ms or more, and DataLoader workers
# (num_workers > 0) prefetch a batch this cheap while the GPU computes.
INPUT_BOUND_FLOOR_S = 0.005
GATE_UPDATES = 2  # the updates the gates make on one stepper: the first and a later one
# the run the gates' stepper is built for: a task's own schedule (a one-cycle over Lightning's
# estimated_stepping_batches, a Trainer's num_training_steps) is sized for a campaign of this
# many updates and the gates make its first GATE_UPDATES - never a schedule squeezed into the
# gates' two updates, whose second would run at the cycle's final, vanishing rate
CAMPAIGN_UPDATES = DEFAULT_UPDATES
INPUT_TIMED_UPDATES = 3  # at least this many updates are timed: the judgement takes medians
INPUT_BOUND_CAUSES = ("data not next to the process (network or slow disk)",
                      "expensive online preprocessing (do it once, offline, or in DataLoader "
                      "workers: num_workers > 0)",
                      "a synchronisation that blocks prefetching (e.g. reading a metric "
                      "from the device every step)")


@dataclass
class GateSettings:
    """The planned settings the gates run at."""

    shape: UpdateShape = UpdateShape(micro_batch=2, accumulation=8)
    eval_batch: int = 16
    length: int = 0  # positions per sequence in the measured batches (0: the data's longest)
    device: str = "cpu"
    lr: float = 1e-3
    seed: int = 0
    device_memory_gib: float = 0.0  # the rental GPU's memory; 0 = no limit stated
    headroom: float = 0.2  # share of device memory kept free
    input_bound_threshold: float = 0.3  # data-wait share of an update above which data warns
    input_bound_floor_s: float = INPUT_BOUND_FLOOR_S  # ... and above this median wait (s)
    input_updates: int = 4  # updates timed for the input pipeline (at least 3)
    init_tolerance: float = 0.5  # relative gap allowed between initial loss and ln(outputs)
    resume_tolerance: float = 0.0  # max |difference| after resume (0: bit-exact, the CPU rule)
    grad_clip: float | None = 1.0  # the updates' clipping: GateRun takes the task's grad_clip

    def plan(self) -> Plan:
        return Plan(self.shape, self.length or None, self.eval_batch)

    def train_config(self, updates: int = CAMPAIGN_UPDATES) -> TrainConfig:
        """The loop's configuration: by default the stepper the gates measure, built for a
        campaign's length (its schedule sized so), of which they make the first updates;
        `updates` for a run that makes them all (the timed input pipeline)."""
        return TrainConfig(self.shape, updates=updates, lr=self.lr, seed=self.seed,
                           device=self.device, grad_clip=self.grad_clip or 0.0)


@dataclass
class GateRow:
    """One phase: its inputs, memory counters (bytes), time and verdict."""

    phase: str
    micro_batch: int
    seq_len: int
    eval_batch: int
    precision: str
    device: str
    counter: str = ""
    baseline_bytes: int | None = None
    peak_allocated_bytes: int | None = None
    allocated_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    reserved_bytes: int | None = None
    alloc_retries: int | None = None
    ooms: int | None = None
    rss_peak_bytes: int | None = None
    time_s: float = 0.0
    verdict: str = "fail"  # "pass", "warn" (does not fail the run) or "fail"
    detail: str = ""
    remediation: str = ""


@dataclass
class GateReport:
    rows: list[GateRow]
    pipeline: pd.DataFrame  # per update: data wait vs compute
    figures: dict[str, Any] = field(default_factory=dict)
    train_items: list[Item] = field(default_factory=list, repr=False)
    val_items: list[Item] = field(default_factory=list, repr=False)

    @property
    def verdict(self) -> str:
        return "pass" if all(r.verdict != "fail" for r in self.rows) else "fail"

    def table(self) -> pd.DataFrame:
        return pd.DataFrame([asdict(r) for r in self.rows])


def input_bound(pipeline: pd.DataFrame, settings: GateSettings,
                encode_s: float = 0.0) -> tuple[bool, str]:
    """Whether the timed updates are input-bound - the median data wait per update above both
    `input_bound_threshold` of the median update and `input_bound_floor_s` (see
    INPUT_BOUND_FLOOR_S) - and the measurement in words."""
    if not len(pipeline):
        return False, "input pipeline not timed: the training step failed"
    wait, update = float(pipeline.data_s.median()), float(pipeline.time_s.median())
    share, floor = wait / max(update, 1e-12), settings.input_bound_floor_s
    words = (f"data wait {wait * 1e3:.2f} ms per update, {share:.0%} of the update's "
             f"{update * 1e3:.2f} ms (medians of {len(pipeline)} updates)" + (
                 f" (of which encoding {encode_s * 1e3:.2f} ms per example, paid on every pass "
                 "as in a Dataset that encodes in __getitem__)" if encode_s else ""))
    over_share = share > settings.input_bound_threshold
    if over_share and wait > floor:
        return True, words + (f" - input-bound: above {settings.input_bound_threshold:.0%} of "
                              f"the update and the {floor * 1e3:g} ms floor per update (on a "
                              "rented GPU the update gets faster, the wait does not)")
    if over_share:
        words += (f"; above {settings.input_bound_threshold:.0%} but under the {floor * 1e3:g} "
                  "ms floor per update, so no warning: a wait this short is timing noise here "
                  "and DataLoader workers hide it on the rental")
    return False, words


def encode_seconds(task: Task, raw: list[dict], examples: int = 32) -> float:
    """Median seconds `encode` takes for one raw example (0 without raw examples)."""
    times = []
    for ex in raw[:examples]:
        start = time.perf_counter()
        task.encode(ex)
        times.append(time.perf_counter() - start)
    return float(np.median(times)) if times else 0.0
