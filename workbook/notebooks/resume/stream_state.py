"""Notebook 07's experiments on a training pipeline's own state, in a debugger's order: its state
read before and after a partial pass (does the position move while a pass is read?), its state
of three points loaded into new pipelines (where does each start: at its place, at 0, at the
run's count modulo a length?), and a resume resumed again (does state_dict advance after
load_state_dict?). A cause is named only when what was measured shows it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ...base.errors import WorkbookError
from ...contract.pipeline import OWN_STATE, DataPosition, open_pipeline
from ...contract.task import Task
from ...training.loop import TrainConfig
from .position import find_start, length_of, pipeline_order

K1, K2, AHEAD = 3, 7, 3  # the points of a pass whose state is loaded; examples read after each
FIRST_PASS_MOST = 10_000  # examples of the first pass read at most (a pass beyond: no probes)


def same_state(a: Any, b: Any) -> bool:
    """Two pipeline states hold the same values (tensors compared by value)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and \
            a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


@dataclass
class Findings:
    """What the experiments measured, each '' when it found nothing: `partial` (the state
    before and after a partial pass), `restore` (a loaded state's start, by restore order:
    False = set_epoch then load_state_dict, True = a training loop's load, then set_epoch),
    `after_load` (a resume resumed again); `tested` says what ran, for a suspicion."""

    partial: str = ""
    restore: dict[bool, str] = field(default_factory=lambda: {False: "", True: ""})
    after_load: str = ""
    tested: str = ""

    def cause(self, guessed: str, twice: bool = False, loop_order: bool = False) -> str:
        """The confirmed cause of a resume that read elsewhere (its measurement, cause and
        fix), else the `guessed` one worded as a suspicion with the experiment to run."""
        confirmed = ([self.after_load] if twice else []) + \
            [self.partial, self.restore[loop_order]]
        found = next((c for c in confirmed if c), "")
        if found:
            return found
        if not self.tested:
            return guessed
        return (f"suspected, not confirmed: {guessed} ({self.tested}) - test it: load the "
                "checkpoint's pipeline state into a new pipeline as your loop does and compare "
                "its first examples with the uninterrupted run's at that point")


class Probe:
    """The task's pipeline opened anew for each experiment, with the run's seed, workers,
    micro-batch and pass limit."""

    def __init__(self, task: Task, cfg: TrainConfig, limit: int):
        self.task, self.cfg, self.limit = task, cfg, limit
        self.orders: dict[int, list[str]] = {}

    def open(self, loop_order: bool = False):
        return open_pipeline(self.task, self.cfg.seed, workers=self.cfg.workers,
                             micro_batch=self.cfg.shape.micro_batch, limit=self.limit,
                             loop_order=loop_order)

    def read(self, start: DataPosition, count: int, loop_order: bool = False
             ) -> tuple[list[str], DataPosition | None]:
        """`count` examples from `start` in a new pipeline, and its position after them."""
        pipe, ids = self.open(loop_order), []
        for _, _, example in pipe.read(start):
            if example is None:
                continue
            ids.append(str(example[self.task.id_key]))
            if len(ids) >= count:
                return ids, pipe.position()
        return ids, None

    def locate(self, got: list[str], epoch: int, upto: int) -> tuple[int, int] | None:
        """(pass, example) of a fresh pipeline's passes where `got` begins."""
        order = pipeline_order(self.task, self.cfg.seed, workers=self.cfg.workers,
                               micro_batch=self.cfg.shape.micro_batch)
        for e in dict.fromkeys([epoch, 0, 1, 2]):
            if len(self.orders.get(e, [])) < upto:
                self.orders[e] = order(e, upto=upto)
            f = find_start(self.orders[e], got)
            if f is not None:
                return e, f
        return None


def uninterrupted(probe: Probe) -> tuple[dict[int, list[str]], dict]:
    """The first two passes as one pipeline reads them (the second to K2 + AHEAD), and its
    position before anything is read and after K1 and K2 examples of each pass."""
    pipe = probe.open()
    marks: dict = {(0, 0): pipe.position()}
    passes: dict[int, list[str]] = {0: [], 1: []}
    for epoch, read, example in pipe.read():
        if example is None:
            if epoch:
                break
            continue
        passes[epoch].append(str(example[probe.task.id_key]))
        if read in (K1, K2):
            marks[(epoch, read)] = pipe.position()
        if (epoch and read >= K2 + AHEAD) or len(passes[0]) > FIRST_PASS_MOST:
            break
    return passes, marks


def partial_pass(passes: dict[int, list[str]], marks: dict) -> str:
    """'' unless the state after K2 examples of the first pass is the state before it."""
    if not same_state(marks[(0, 0)].state, marks[(0, K2)].state):
        return ""
    again = passes[1][:K2] == passes[0][:K2]
    return (f"the pipeline's state_dict() was the same before and after {K2} examples of pass 0 "
            "(a pass read partway, as a checkpoint mid-pass or a loop that breaks early leaves "
            "it)" + (f", and pass 1 read pass 0's first {K2} examples again" if again else "")
            + ": its position commits only when __iter__ runs to its end (Lightning-AI/litData"
            "#649; or in steps longer than that), so a resume mid-pass and the pass after an "
            "early break go back to where the state last moved - advance the state as each "
            "example is yielded (take up a loaded state at the top of __iter__), not after the "
            "loop")


def restored_at(probe: Probe, passes: dict, marks: dict, loop_order: bool) -> str:
    """'' unless the state of example K1 or K2 of pass 0 or 1, loaded into a new pipeline,
    starts elsewhere; then where each started and the cause that fits them all."""
    points, wrong = [], False
    for epoch, k in ((0, K1), (0, K2), (1, K1), (1, K2)):
        got, _ = probe.read(marks[(epoch, k)], AHEAD, loop_order)
        expected = passes[epoch][k:k + AHEAD]
        total = (len(passes[0]) if epoch else 0) + k
        where = (epoch, k) if got == expected else \
            probe.locate(got, epoch, total + len(passes[0]) + AHEAD)
        if where is None:
            return (f"a new pipeline given its own state of example {k} of pass {epoch} read "
                    f"{got[0]!r} first, at no position of passes 0-2 of a fresh pipeline: the "
                    "order after a load is another (a shuffle buffer whose content the state "
                    "does not hold, or a shuffle reseeded on load) - keep the order in the "
                    "state (shuffle shards by a seed and the epoch), or expect other examples "
                    "after every resume") if got else ""
        wrong = wrong or got != expected
        points.append((epoch, k, total, *where))
    if not wrong:
        return ""
    measured = ("a new pipeline given its own state of " + ", ".join(
        f"example {k} of pass {e}" for e, k, *_ in points) + (" (load_state_dict, then "
        "set_epoch, as a training loop restores)" if loop_order else "") + " started at " +
        ", ".join(f"example {f} of pass {g}" for *_, g, f in points))
    return measured + ": " + fitting_cause(points, len(passes[0]), probe, loop_order)


def fitting_cause(points: list[tuple], first_pass: int, probe: Probe, loop_order: bool) -> str:
    """The cause every point fits (pass, example, examples read in all, where it started)."""
    later = [p for p in points if p[0]]
    if all(f == 0 for *_, f in later):
        how = ("set_epoch after load_state_dict dropped the position it gave back) - "
               "set_epoch must not reset a position loaded for the same pass" if loop_order
               else "__iter__ starts each pass at its beginning) - take up the position "
               "load_state_dict gave back at the top of __iter__")
        return "the pass restarted from its beginning on restore (an epoch guard: " + how
    mb = probe.cfg.shape.micro_batch
    if mb > 1 and all(f == k * mb for _, k, _, _, f in points):
        return (f"a skip counted in batches where the state counts examples (x the "
                f"micro-batch of {mb}) - skip the examples the state holds")
    offsets = {f - k for _, k, _, _, f in points}
    if len(offsets) == 1 and all(g == e for e, _, _, g, _ in points):
        c = offsets.pop()
        return (f"{c} example(s) lost at the resume point (the state counted an example read "
                "ahead but not yet trained on - one in flight at a yield boundary)" if c > 0
                else f"{-c} example(s) read again")
    counts = [t for _, _, t, _, _ in points]
    for length in range(2, max(counts) + 2):
        if all(f == t % length for _, _, t, _, f in points):
            own = length_of(probe.open().source)
            read = ", ".join(map(str, counts))
            said = (f"the examples read in all ({read}) from a pass's start (" + (
                f"their count modulo the pipeline's len() of {own}, above it" if own else
                "a stream without a usable length: the run counted as one pass") + ")"
                if length > max(counts) else f"the examples read in all ({read}) modulo "
                f"{length}" + (f", not the pipeline's len() of {own}" if own and own != length
                               else ""))
            return (f"the resume skipped by a length the stream does not have (the starts are "
                    f"{said}; the pilot's pass 0 has {first_pass}) - skip by the examples read "
                    "in the pass (the checkpoint's position), or give the stream a state_dict "
                    "that holds its position (huggingface/transformers#26413)")
    return ("no single cause fits every point (the pass number or the order after a load "
            "differs) - compare what your load_state_dict restores with what state_dict saved")


def resumed_again(probe: Probe, passes: dict, marks: dict) -> str:
    """'' unless a pipeline resumed from example K1 of pass 1 and read to K2 gives a state
    that resumes elsewhere than the uninterrupted pipeline's state at K2."""
    got, after = probe.read(marks[(1, K1)], K2 - K1)
    if got != passes[1][K1:K2] or after is None or same_state(after.state,
                                                              marks[(1, K2)].state):
        return ""
    again, _ = probe.read(after, AHEAD)
    if again == passes[1][K2:K2 + AHEAD]:
        return ""
    where = probe.locate(again, 1, len(passes[0]) + K2 + AHEAD)
    frozen = same_state(after.state, marks[(1, K1)].state)
    measured = (f"resumed from its state of example {K1} of pass 1 and read {K2 - K1} examples "
                "exactly, the pipeline's state_dict() " + (
                    "was still the state it had loaded" if frozen else
                    "was not an uninterrupted pipeline's at that point") +
                "; a second resume from it started at " + (
                    f"example {where[1]} of pass {where[0]}" if where else "none of passes 0-2"))
    if frozen or where == (1, K1):
        return (measured + ": the pipeline's state did not advance after load_state_dict, so a "
                "second resume restarts from the first - let state_dict report the position "
                "reached after a load, as after a fresh start")
    if where and where[1] == 0:
        return (measured + ": the pipeline's state did not advance after load_state_dict (it "
                "reports a fresh stream's start, huggingface/datasets#8295), so every resume "
                "after the first restarts the stream - let state_dict report the position "
                "reached after a load, as after a fresh start (datasets: a release with that "
                "fix)")
    return (measured + ": the state state_dict gives after a load is not the position reached "
            "- let state_dict report the position reached after a load, as after a fresh start")


def probe_pipeline(task: Task, cfg: TrainConfig, limit: int = 0) -> Findings | None:
    """The three experiments on the task's pipeline; None for a pipeline resumed by
    count-and-skip (no state of its own) or one too short or failing to be probed."""
    probe = Probe(task, cfg, limit)
    try:
        if probe.open().resumes_by != OWN_STATE:
            return None
        passes, marks = uninterrupted(probe)
        if len(passes[1]) < K2 + AHEAD or any((e, k) not in marks for e in (0, 1)
                                               for k in (K1, K2)):
            return None
        found = Findings(partial=partial_pass(passes, marks))
        found.restore = {order: restored_at(probe, passes, marks, order)
                         for order in (False, True)}
        if not found.restore[False]:
            found.after_load = resumed_again(probe, passes, marks)
        found.tested = (f"its state of examples {K1} and {K2} of a pass loaded into a new "
                        "pipeline started at its place, and a resume resumed again went on")
        return found
    except WorkbookError:  # the resumes themselves report the pipeline's failure
        return None
