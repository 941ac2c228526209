"""Notebook 09, inside each process: the workbook's loop under torch.distributed with
DistributedDataParallel, one process per replica, started by torchrun
(`torchrun --standalone --nproc_per_node=N -m workbook ddp --spec JSON --out DIR`).

Every rank measures what the multi-host rules need; rank 0 gathers it and writes `result.json`
and the final weights. Verdicts are not decided here but in `parallel`, in the notebook's
process. Gloo on the CPU, NCCL when the spec asks for CUDA. What the ranks share (joining the
process group, gathering, digests, batch-norm statistics) is `ranks`'s."""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import os
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_model
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from ..base.errors import WorkbookError
from ..contract.data import Batch, Item, epoch_order, loader, micro_batches
from ..contract.task import Task, load_recorded_task, load_task
from ..storage import schemas
from ..storage.artifacts import write_file
from ..storage.schemas import Count, StrictStr
from . import checkpoint as ckpt
from .deviation import relative_deviation
from .evaluation import evaluation_sums
from .launch_spec import LaunchBase
from .loop import Position, Stepper, build_stepper, seed_everything
from .memory import measure, state_tensors
from .ranks import (
    WriteAudit,
    bn_buffers,
    bn_check,
    check_world,
    digest,
    gather,
    in_launch,
    now,
    sync_batch_norm,
)

# Planted multi-process bugs, each named by one rule of `parallel.RULES`.
FAULTS = {
    "rank_seed": "initialisation seeded with the rank",
    "same_order": "every rank reads the same examples",
    "all_ranks_write": "every rank writes the checkpoint",
    "fixed_order": "the epoch order never changes (no set_epoch)",
    "bn_rank0": "batch-norm statistics of rank 0 only",
    "rank_mean_loss": "loss averaged per rank before the all-reduce",
}
RESULT = "result.json"
WEIGHTS = "weights.safetensors"


@dataclass
class ReplicaSpec(LaunchBase):
    """What one DDP launch runs: the shared settings, the gradient check's size and a planted
    fault."""

    what = "replica settings"

    check_examples: Count = 16  # the 1 x N against R x N/R gradient check
    fault: StrictStr = ""

    @classmethod
    def from_dict(cls, data: Any) -> ReplicaSpec:
        spec = super().from_dict(data)
        if spec.fault and spec.fault not in FAULTS:
            raise WorkbookError(f"unknown planted fault {spec.fault!r}", f"use {list(FAULTS)}")
        return spec


# --- what this process writes ----------------------------------------------------------------
def _artifact(relative: str) -> str:
    """The artifact a written path belongs to: `.ckpt-5.partial-123/x` -> `ckpt-5`."""
    first = relative.split(os.sep)[0]
    first = re.sub(r"^\.(.+?)\.(partial-\d+|[^.]*\.tmp)$", r"\1", first)
    return first


# --- data: one shard of every update per rank ------------------------------------------------
def update_groups(n: int, spec: ReplicaSpec, epoch: int, world: int) -> list[list[int]]:
    """The example indices of each update of a pass, over all ranks: the pass order is a pure
    function of (seed, epoch) - what `DistributedSampler.set_epoch` gives - so every rank
    computes the same groups without talking to the others."""
    order = epoch_order(n, spec.seed, 0 if spec.fault == "fixed_order" else epoch)
    per_update = spec.shape.micro_batch * spec.shape.accumulation * world
    if spec.drop_partial:
        order = order[: len(order) // per_update * per_update]
    return [order[s:s + per_update] for s in range(0, len(order), per_update)]


def shard(group: list[int], rank: int, world: int, micro_batch: int,
          fault: str = "") -> tuple[list[list[int]], int]:
    """This rank's micro-batches of one update (every `world`-th example from its rank on) and
    how many zero-weight filler micro-batches keep it in step with the rank that has most."""
    mine = group[(0 if fault == "same_order" else rank)::world]
    steps = math.ceil(math.ceil(len(group) / world) / micro_batch)
    batches = [mine[i:i + micro_batch] for i in range(0, len(mine), micro_batch)]
    return batches, steps - len(batches)


def replica_updates(task: Task, items: list[Item], spec: ReplicaSpec, rank: int, world: int,
                    start: Position | None = None) -> Iterator[tuple[Position, list, list]]:
    """Endless (position, micro-batches, weights) of this rank, pass after pass; a filler
    micro-batch (weight 0) repeats a real example of the update and contributes nothing."""
    start = start or Position()
    epoch, skip = start.epoch, start.group
    while True:
        groups = update_groups(len(items), spec, epoch, world)[skip:]
        plans = [shard(g, rank, world, spec.shape.micro_batch, spec.fault) for g in groups]
        lists = [mb for (batches, fill), g in zip(plans, groups, strict=True)
                 for mb in batches + [[g[0]]] * fill]
        stream = iter(loader(task, items, lists, 0, seed=spec.seed * 100_003 + epoch))
        for index, (batches, fill) in enumerate(plans, start=skip):
            yield (Position(epoch, index), [next(stream) for _ in range(len(batches) + fill)],
                   [1.0] * len(batches) + [0.0] * fill)
        epoch, skip = epoch + 1, 0


# --- one update across ranks ------------------------------------------------------------------
class AllReduceClock:
    """A DDP communication hook: PyTorch's own all-reduce, counted and timed."""

    def __init__(self):
        self.calls, self.seconds = 0, 0.0
        self.pre_scale = 1.0  # planted fault only: scale this rank's gradient before


    def hook(self, state, bucket):  # no annotations: DDP checks them against its own types
        start = time.perf_counter()
        self.calls += 1
        if self.pre_scale != 1.0:
            bucket.buffer().mul_(self.pre_scale)

        def done(fut: torch.futures.Future) -> torch.Tensor:
            self.seconds += time.perf_counter() - start
            return fut.value()
        return default_hooks.allreduce_hook(state, bucket).then(done)


def wrap(model: nn.Module, device: torch.device) -> tuple[DistributedDataParallel,
                                                         AllReduceClock]:
    """DDP around `model` with the gradient all-reduce counted and timed. Buffers are not
    copied from rank 0 at every forward: batch-norm statistics stay each rank's own until
    `sync_batch_norm` averages them (the rule checks that it does)."""
    import inspect

    own_buffers = ({"forward_sync_buffers": False} if "forward_sync_buffers" in
                   inspect.signature(DistributedDataParallel).parameters
                   else {"broadcast_buffers": False})
    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda"
                                  else None, **own_buffers)
    clock = AllReduceClock()
    ddp.register_comm_hook(None, clock.hook)
    return ddp, clock


def replica_update(stepper: Stepper, clock: AllReduceClock, batches: list[Batch],
                   weights: list[float], world: int, fault: str = "",
                   readings: dict | None = None, step: bool = True) -> dict[str, float]:
    """One update on this rank: gradients synchronised only on the last micro-step (no_sync
    before), the target count all-reduced, and the gradient divided by the targets of the WHOLE
    update across ranks (DDP already averaged over ranks), so 1 x N and R x N/R agree. With
    `readings` the memory of the first forward, the last backward and the step is measured;
    without `step` the normalised gradients are left in place."""
    ddp, device = stepper.model, stepper.device
    loss_sum = torch.zeros((), device=device)
    local = torch.zeros((), device=device)
    times = {"forward + loss": 0.0, "backward": 0.0}
    for i, (batch, weight) in enumerate(zip(batches, weights, strict=True)):
        last = i == len(batches) - 1
        with contextlib.nullcontext() if last else ddp.no_sync():
            t0 = now(device)
            with _measured(readings, "forward + loss", stepper, i == 0):
                _, summed, count = stepper.forward_loss(batch.to(device))
            if weight:
                loss_sum += summed.detach().float()
                local += count
            if last and fault == "rank_mean_loss":  # the classic: each rank's own mean,
                clock.pre_scale = 1.0 / max(float(local), 1.0)  # then DDP's average
            t1 = now(device)
            with _measured(readings, "backward", stepper, last):
                stepper.backward(summed * weight)
            t2 = now(device)
        times["forward + loss"] += t1 - t0
        times["backward"] += t2 - t1
    clock.pre_scale = 1.0
    totals = torch.stack([loss_sum, local.float()])
    dist.all_reduce(totals)
    stepper.normalise(1.0 if fault == "rank_mean_loss" else float(totals[1]) / world)
    out = {"loss": float(totals[0] / totals[1].clamp(min=1)), "targets": float(totals[1]),
           "local_targets": float(local), **times}
    if step:
        t3 = now(device)
        with _measured(readings, "update", stepper, True):
            out["grad_norm"] = float(stepper.step())
        out["update"] = now(device) - t3
    return out


@contextlib.contextmanager
def _measured(readings: dict | None, phase: str, stepper: Stepper, now: bool):
    if readings is None or not now:
        yield
        return
    model = stepper.model.module
    with measure(stepper.device, state_tensors(model, stepper.optimizer)) as held:
        yield
    readings[phase] = asdict(held.reading)


# --- the launch -------------------------------------------------------------------------------
def rank_evaluation(task: Task, model: nn.Module, items: list[Item], eval_batch: int,
                    device: torch.device, precision: str = "fp32") -> dict[str, Any]:
    """One rank's evaluation of its shard: its sums, beside how the task's framework reduces
    each metric over ranks (`Task.framework.metric_reductions`, filled as it evaluates)."""
    sums, _ = evaluation_sums(task, model, items, eval_batch, device, precision)
    return {"examples": len(items), "sums": sums,
            "reductions": dict(task.framework.metric_reductions)}


def _eval_split(task: Task, model: nn.Module, items: list[Item], spec: ReplicaSpec,
                rank: int, world: int, device: torch.device) -> dict[str, Any]:
    """Each rank evaluates its shard; the sums are added over ranks (each metric as its
    framework reduces it); rank 0 also evaluates everything alone, the reference the reduced
    result must equal."""
    precision = spec.shape.precision
    every = gather(rank_evaluation(task, model, items[rank::world], spec.eval_batch, device,
                                   precision))
    single = None
    if rank == 0:
        single, _ = evaluation_sums(task, model, items, spec.eval_batch, device, precision)
    return {"ranks": every, "single": single}


def gradient_check(task: Task, model: nn.Module, items: list[Item], spec: ReplicaSpec,
                   rank: int, world: int, device: torch.device) -> list[dict[str, Any]]:
    """One update over the same N examples (`check_items`): 1 x N in one process (rank 0, the
    reference) against R x N/R, R x (2 x N/2R) with accumulation, and N - 1 examples in unequal
    shares (a partial update). Rank 0 also computes what a mean per rank would give, so a
    check that cannot tell the two apart says so. Dropout and batch norm in eval behaviour, as
    in notebook 04's check: they legitimately change with the batch."""
    n = spec.check_examples
    if n % (2 * world) or n > len(items):
        raise WorkbookError(f"check_examples={n} must be a multiple of 2 x {world} replicas and "
                            f"at most the {len(items)} training examples",
                            f"use check_examples={2 * world * max(1, len(items) // (2 * world))}"
                            if len(items) >= 2 * world else "give the task more examples")
    items = check_items(task, items, n, world)
    reference = None
    rows, rank_mean = [], {}
    for case, examples, accumulation in (("equal", n, 1), ("accumulation", n, 2),
                                         ("partial", n - 1, 1)):
        replica = copy.deepcopy(model).eval()
        ddp, clock = wrap(replica, device)
        stepper = Stepper(task, ddp, torch.optim.SGD(ddp.parameters(), lr=0.0), None, device,
                          grad_clip=0.0)
        if rank == 0:
            reference = reference_gradient(task, model, items[:examples], device)
            if examples not in rank_mean:  # accumulation does not change a rank's own mean
                rank_mean[examples] = relative_deviation(rank_mean_gradient(
                    task, model, items[:examples], world, device)[0], reference)
        mine = items[:examples][rank::world]  # the check's own split: normalisation only
        # collated by `collate`: a training collate's per-batch draw (mixup) would differ
        # between the ranks' split and the reference, which compare normalisation only
        batches = list(micro_batches(task, mine, math.ceil(len(mine) / accumulation),
                                     training=False))
        out = replica_update(stepper, clock, batches, [1.0] * len(batches), world, spec.fault,
                             step=False)
        grads = {k: p.grad for k, p in replica.named_parameters() if p.grad is not None}
        ranks = gather({"digest": digest(grads), "targets": out["local_targets"],
                        "data": data_digest(mine)})
        shares = gather(len(mine))
        row = {"case": case, "split": " + ".join(
                   f"{accumulation} x {math.ceil(k / accumulation)}" for k in shares),
               "examples": examples, "accumulation": accumulation, "all_reduces": clock.calls,
               "identical_on_ranks": len({r["digest"] for r in ranks}) == 1,
               "targets_per_rank": [r["targets"] for r in ranks],
               "ids": [str(it.id) for it in items[:examples]]}
        if reference is not None:
            row["max_relative_deviation"] = relative_deviation(grads, reference)
            row["rank_mean_deviation"] = rank_mean[examples]
            # the tensors each rank's loss received against rank 0's of the same examples
            row["data_differs_on_ranks"] = [
                r for r, got in enumerate(ranks)
                if got["data"] != data_digest(items[:examples][r::world])]
        rows.append(row)
    return rows


def data_digest(items: list[Item]) -> str:
    """One digest of the tensors of `items`, in order."""
    return digest({f"{i}/{k}": t for i, it in enumerate(items) for k, t in it.tensors.items()})


def example_targets(task: Task, item: Item) -> int:
    """The targets one example gives the loss, read from its labels (1 without labels)."""
    labels = item.tensors.get("labels")
    return 1 if labels is None else task.target_count(labels)


def check_items(task: Task, items: list[Item], n: int, world: int) -> list[Item]:
    """The gradient check's N examples: the first N of the split, unless their partial case
    (the first N - 1, example i on rank i % R) gives every rank the same target count - there a
    mean per rank gives the right gradient too, so the check could not catch it. Then two
    examples of different target counts change places across ranks (or one from the rest of the
    split comes in), which makes the shares unequal; the same on every rank (a pure function)."""
    chosen = list(items[:n])
    counts = [example_targets(task, it) for it in chosen]
    shares = [sum(counts[i] for i in range(r, n - 1, world)) for r in range(world)]
    if len(set(shares)) > 1:
        return chosen
    counts += [example_targets(task, it) for it in items[n:]]
    for i in range(n - 1):
        for j in range(i + 1, len(items)):  # inside the N first: the same examples, reordered
            moves = j >= n - 1 or j % world != i % world  # to another rank, or out of the share
            if moves and counts[j] != counts[i]:
                if j < n:
                    chosen[i], chosen[j] = chosen[j], chosen[i]
                else:
                    chosen[i] = items[j]
                return chosen
    return chosen  # every example gives the same count and the shares are equal: no choice


def reference_gradient(task: Task, model: nn.Module, items: list[Item],
                        device: torch.device) -> dict[str, torch.Tensor]:
    """The gradient of one update over `items` as one micro-batch in this process alone."""
    ref = copy.deepcopy(model).eval()
    Stepper(task, ref, torch.optim.SGD(ref.parameters(), lr=0.0), None, device) \
        .accumulate(list(micro_batches(task, items, len(items), training=False)))
    return {k: p.grad for k, p in ref.named_parameters() if p.grad is not None}


def rank_mean_gradient(task: Task, model: nn.Module, items: list[Item], world: int,
                       device: torch.device) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The gradient the classic bug gives, in this process alone: each rank's share
    (`items[rank::world]`) normalised by its own targets, then DDP's average over the ranks;
    and the targets the loss counted per share."""
    ref = copy.deepcopy(model).eval()
    stepper = Stepper(task, ref, torch.optim.SGD(ref.parameters(), lr=0.0), None, device)
    total: dict[str, torch.Tensor] = {}
    counts = []
    for r in range(world):
        ref.zero_grad(set_to_none=True)
        _, summed, count = stepper.forward_loss(next(micro_batches(
            task, items[r::world], len(items), training=False)).to(device))
        stepper.backward(summed)
        counts.append(float(count))
        scale = 1.0 / (max(counts[-1], 1.0) * world)
        for k, p in ref.named_parameters():
            if p.grad is not None:
                total[k] = total.get(k, 0) + p.grad * scale
    return total, counts


def run_replica(spec: ReplicaSpec, out: Path, resume_from: Path | None = None,
                task: Task | None = None) -> None:
    """The body of one process of a launch (torchrun set RANK, WORLD_SIZE, LOCAL_RANK); what
    it wrote is named by artifact."""
    in_launch(spec, out / RESULT, functools.partial(_launch, spec, out, resume_from, task),
              _artifact)


def _launch(spec: ReplicaSpec, out: Path, resume_from: Path | None, task: Task | None,
            rank: int, world: int, device: torch.device, audit: WriteAudit) -> dict[str, Any]:
    seed_everything(spec.seed)  # a task that builds its model on loading (a TRL trainer, built
    # once: a fresh score head drawn before the trainer seeds) builds the same on every rank
    task = task if task is not None else load_task(spec.task, **spec.task_options)
    data, cfg = spec.prepared(task)
    items, val = data.train, data.validation
    seed_everything(spec.seed + (rank if spec.fault == "rank_seed" else 0))
    model = task.build_model().to(device)
    if dist.get_backend() == "nccl":  # SyncBatchNorm gathers over NCCL only
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    result: dict[str, Any] = {"spec": asdict(spec), "world": world,
                              "init_digest": gather(digest(model.state_dict()))}
    position, first = Position(), 1
    if resume_from is None:
        result["gradient_check"] = gradient_check(task, model, items, spec, rank, world, device)
        seed_everything(spec.seed + (rank if spec.fault == "rank_seed" else 0))
    ddp, clock = wrap(model, device)
    stepper = build_stepper(task, cfg, model)  # build_optimizer gets the module, as in 02-07
    stepper.model = ddp
    if resume_from is not None:
        position, first = _restore(resume_from, stepper, rank, world)
    stream = replica_updates(task, items, spec, rank, world, position)
    records, readings, events = [], {}, {}
    for step in range(first, spec.updates + 1):
        t0 = now(device)
        where, batches, weights = next(stream)
        data_s = now(device) - t0
        calls, seconds = clock.calls, clock.seconds
        lr = stepper.optimizer.param_groups[0]["lr"]
        row = replica_update(stepper, clock, batches, weights, world, spec.fault,
                             readings if step == first + 1 else None)
        real = [b for b, w in zip(batches, weights, strict=True) if w]
        records.append({"step": step, "epoch": where.epoch, "group": where.group,
                        "lr": lr, "data": data_s, **row,
                        "micro_batches": len(batches), "fillers": weights.count(0.0),
                        "examples": sum(len(b) for b in real),
                        "all_reduces": clock.calls - calls,
                        "all_reduce": clock.seconds - seconds,
                        "ids": [str(i) for b in real for i in b.ids]})
        if step == spec.checkpoint_at:
            t = now(device)
            events["checkpoint"] = _checkpoint(out, step, Position(where.epoch, where.group + 1),
                                               stepper, spec, task, rank, world)
            events["checkpoint"]["seconds"] = now(device) - t
    t = now(device)
    sync = sync_batch_norm(model, world, spec.fault)
    evaluation = _eval_split(task, model, val, spec, rank, world, device)
    eval_s = now(device) - t
    ranks = gather({"records": records, "memory": readings, "eval_s": eval_s,
                    "final_digest": digest(model.state_dict()),
                    "collisions": events.get("checkpoint", {}).pop("collisions", []),
                    "checkpoint_s": events.get("checkpoint", {}).get("seconds")})
    if rank == 0:
        write_file(out / WEIGHTS, lambda tmp: save_model(model, str(tmp)), "final weights")
        result.update({"ranks": ranks, "evaluation": evaluation,
                       "batch_norm_final": bn_check(sync, bn_buffers(model)),
                       "checkpoint": events.get("checkpoint"),
                       "train_examples": len(items), "train_ids": [str(i.id) for i in items],
                       "first_step": first})
    return result


def _checkpoint(out: Path, step: int, after: Position, stepper: Stepper, spec: ReplicaSpec,
                task: Task, rank: int, world: int) -> dict[str, Any]:
    """Batch-norm statistics synchronised, every rank's random state gathered, then rank 0
    writes one checkpoint (with the planted fault, every rank tries)."""
    model = stepper.model.module
    sync = sync_batch_norm(model, world, spec.fault)
    rngs = gather(ckpt.rng_state())
    path = out / f"ckpt-{step:06d}"
    collisions = []
    if rank == 0 or spec.fault == "all_ranks_write":
        try:
            ckpt.save_checkpoint(path, model, stepper.optimizer, stepper.scheduler,
                                 stepper.scaler,
                                 {"step": step, "epoch": after.epoch, "group": after.group,
                                  "micro_batch_in_group": 0, "world": world, "rank_rng": rngs},
                                 {"recipe": {"task": spec.task,
                                             "task_options": spec.task_options},
                                  "replica_spec": asdict(spec), "task_name": task.name})
        except WorkbookError as exc:  # two ranks writing one checkpoint collide
            collisions.append(exc.problem)
    dist.barrier()
    saved = None
    if rank == 0 and (path / ckpt.WEIGHTS).exists():
        ckpt.verify(path)
        saved = load_file(str(path / ckpt.WEIGHTS))
    return {"path": path.name, "batch_norm": bn_check(sync, saved) if rank == 0 else None,
            "collisions": collisions}


def _restore(path: Path, stepper: Stepper, rank: int, world: int) -> tuple[Position, int]:
    """Every rank loads the one checkpoint and its own random state from it."""
    info = ckpt.load_checkpoint(path, stepper.model.module, stepper.optimizer,
                                stepper.scheduler, stepper.scaler, restore_rng=False)
    c = info["counters"]
    schemas.check(schemas.ReplicaCounters, c, Path(path) / ckpt.STATE, "checkpoint state",
                  "resume from a checkpoint of notebook 09's launch", "counters")
    check_world(path, int(c.get("world", 1)), world)
    ckpt.set_rng_state(c["rank_rng"][rank])
    return Position(int(c["epoch"]), int(c["group"])), int(c["step"]) + 1


def read_spec(spec_json: str) -> dict:
    """The launch's --spec as a dict (its "strategy" says which replica runs it)."""
    import json

    try:
        return json.loads(spec_json)
    except json.JSONDecodeError as exc:
        raise WorkbookError(f"--spec is not JSON ({exc.msg} at character {exc.pos})",
                            "quote the whole object for the shell: --spec '{\"task\": ...}'") \
            from None


def main(data: dict, out: str, resume_from: str | None) -> int:
    """`python -m workbook ddp`: one data-parallel process of a launch. A checkpoint to resume
    is verified, and its recorded task compared with the one named here, before anything runs."""
    spec = ReplicaSpec.from_dict(data)
    task = None
    if resume_from is not None:
        ckpt.load_state(resume_from)
        recorded = ckpt.load_meta(resume_from).get("recipe")
        task = load_recorded_task(recorded, spec.task, spec.task_options,
                                  f"checkpoint {resume_from}")
    run_replica(spec, Path(out), Path(resume_from) if resume_from else None, task)
    return 0
