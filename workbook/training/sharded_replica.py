"""Notebook 09's FSDP section, inside each process: the workbook's loop with the model sharded by
FSDP2 (`torch.distributed.fsdp.fully_shard` on every block, then on the root), one process per
rank, started by torchrun through `workbook ddp` (a spec with `"strategy": "fsdp"`). Gloo on the
CPU, NCCL when the spec asks for CUDA and every process has a GPU - the same code path.

One training launch measures what the rules that change under sharding need: the per-rank peak
of every training phase (notebook 03's workload on the sharded model), the first updates against
one process, tied weights under sharding, and a `torch.distributed.checkpoint` (DCP) checkpoint
that every rank writes its shard of. With `plant`, the same processes also write a checkpoint
the classic way (rank 0 only) and train a copy whose tied weights were tied after `fully_shard`.
A second launch, in new processes, resumes from the checkpoint (and loads the planted one).
Verdicts are decided in `parallel`, in the notebook's process. The sharded model is
`sharded_model`'s, the DCP checkpoints `sharded_checkpoint`'s."""

from __future__ import annotations

import copy
import gc
import math
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Literal

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn

from ..base.errors import WorkbookError
from ..contract.data import Batch, Item
from ..contract.task import Task, load_task
from ..storage.artifacts import write_file
from ..storage.schemas import Count, Index, StrictBool, StrictStr
from . import checkpoint as ckpt
from .deviation import max_difference, relative_deviation
from .launch_spec import LaunchBase
from .loop import HeldBehaviour, Position, Stepper, build_stepper, seed_everything
from .memory import measure, rebased
from .ranks import (
    WriteAudit,
    check_world,
    digest,
    gather,
    in_launch,
    now,
    sync_batch_norm,
)
from .replica import RESULT, WEIGHTS, replica_updates
from .sharded_checkpoint import coverage, load_sharded, save_sharded
from .sharded_model import (
    TieWatch,
    blocks,
    full_state,
    live_bytes,
    local_state,
    local_tensor,
    shard_model,
    tie,
    untie,
)
from .workload import (
    CHECKPOINT_SAVE,
    TRAINING_PHASES,
    Plan,
    Workload,
    multi_tensor_step,
    sized_batches,
    targets_of,
)

STRATEGY = "fsdp"
PLANTED_PREFIX = "rank0-only-"  # the planted checkpoint's folder: rank0-only-ckpt-000005
SHARDED_FAULTS = {
    "rank0_checkpoint": "checkpoint saved by rank 0 only under FSDP",
    "tie_after_shard": "model sharded before its tied weights are tied",
}


@dataclass
class ShardedSpec(LaunchBase):
    """What one FSDP launch runs: the shared settings (a shorter run, a checkpoint after
    update 3) and what it measures and plants."""

    what = "FSDP launch settings"

    updates: Count = 6
    validation_limit: Index = 8
    checkpoint_at: Index = 3  # every rank saves its shard after this update (0: none)
    compare_updates: Index = 2  # the first updates compared with one process
    plant: StrictBool = True  # the planted faults in the same processes
    memory: StrictBool = True  # measure every phase's per-rank peak
    plan_length: Index = 0  # positions of the measured workload (0: the data's longest)
    plan_eval_length: Index = 0  # positions of its evaluation batch (0: plan_length)
    train: StrictBool = True  # False: only the measured phases (the benchmark)
    planted_checkpoint: StrictStr = ""  # resume launch: the planted checkpoint to load as well
    strategy: Literal["fsdp"] = STRATEGY

    @property
    def fault(self) -> str:  # the data order of `replica` (no data fault under FSDP)
        return ""


# --- one update across ranks ------------------------------------------------------------------
def sharded_update(stepper: Stepper, batches: list[Batch], weights: list[float],
                   world: int, before_step: Callable[[], None] | None = None
                   ) -> dict[str, float]:
    """One update on this rank: every micro-batch's gradient reduce-scattered (FSDP's default:
    the shards accumulate, the unsharded gradient is freed), the target count all-reduced and
    the gradient divided by the WHOLE update's targets (the reduce-scatter already averaged
    over ranks), so 1 x N and R x N/R agree; then clip and step."""
    device = stepper.device
    loss_sum = torch.zeros((), device=device)
    local = torch.zeros((), device=device)
    for batch, weight in zip(batches, weights, strict=True):
        _, summed, count = stepper.forward_loss(batch.to(device))
        if weight:
            loss_sum += summed.detach().float()
            local += count
        stepper.backward(summed * weight)
    totals = torch.stack([loss_sum, local.float()])
    dist.all_reduce(totals)
    stepper.normalise(float(totals[1]) / world)
    if before_step is not None:
        before_step()
    norm = stepper.step()
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    return {"loss": float(totals[0] / totals[1].clamp(min=1)), "targets": float(totals[1]),
            "local_targets": float(local), "grad_norm": float(norm)}


def reference_updates(task: Task, model: nn.Module, cfg, updates: list[list[list[Batch]]]
                      ) -> dict[str, Any]:
    """The same first updates in this process alone: every rank's examples of an update as
    one process's micro-batches, normalised by the update's targets. Losses, the first
    update's gradient and the parameters after them."""
    stepper = build_stepper(task, cfg, copy.deepcopy(model))
    losses, grads = [], None
    with HeldBehaviour(stepper.model):
        for per_rank in updates:
            loss, n = stepper.accumulate([b for rank in per_rank for b in rank])
            losses.append(float(loss) / float(n))
            if grads is None:
                grads = _grads(stepper.model)
            stepper.step()
    return {"losses": losses, "gradient": grads,
            "params": {k: v.detach().cpu() for k, v in stepper.model.state_dict().items()}}


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's whole gradient on the CPU (gathered from the shards: a collective)."""
    return {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)
            .detach().cpu().clone() for n, p in model.named_parameters() if p.grad is not None}


def compared_run(task: Task, model: nn.Module, cfg, mine: list[tuple[list, list]], world: int,
                 groups: list[list[str]], planted: bool) -> dict[str, Any]:
    """A sharded copy of `model` trained on this rank's share of the first updates in eval
    behaviour (dropout draws nothing, as in the reference): losses, the whole parameters after
    them (rank 0) and whether tied weights stayed one tensor. `planted`: the copy was built
    untied, sharded, then tied (the bug)."""
    copy_ = copy.deepcopy(model)
    if planted:
        untie(copy_, groups)
    shard_model(task, copy_, cfg.shape.precision)
    if planted:
        tie(copy_, groups)
    watch = TieWatch(copy_, groups)
    stepper = build_stepper(task, cfg, copy_)
    losses, grads = [], {}

    def first_gradient() -> None:
        if not grads:
            grads.update(_grads(copy_))

    with HeldBehaviour(copy_):
        for batches, weights in mine:
            losses.append(sharded_update(stepper, batches, weights, world, first_gradient)
                          ["loss"])
    watch.remove()
    params, _ = full_state(copy_)
    tied = {}
    if dist.get_rank() == 0 and groups:
        tied = {"/".join(g): max_difference({n: params[n] for n in g[1:]},
                                            {n: params[g[0]] for n in g[1:]}) for g in groups}
    split = gather(sorted(watch.split))
    return {"losses": losses, "params": params, "gradient": grads,
            "forwards_checked": watch.forwards,
            "split_groups": sorted({g for s in split for g in s}), "saved_tie_difference": tied}


# --- the measured phases ----------------------------------------------------------------------
def _collectives_in_place(model: nn.Module) -> tuple[Any, Any] | None:
    """FSDP2's all-gather and reduce-scatter for the CPU measurement, without an allocation the
    prediction cannot know. Gloo's `all_gather_into_tensor` and `reduce_scatter_tensor` allocate
    process-group temporaries as large as the full buffer on every call, and its worker thread
    can drop the last reference to FSDP's buffer, a free the profiler does not see (both vary
    run to run). NCCL works in FSDP's buffers without either, as the prediction models. So each
    collective is an all-reduce in a scratch buffer made before the measurement (as large as
    the whole unsharded model): the all-gather sums each rank's chunk with zeros, the
    reduce-scatter keeps this rank's chunk of the sum - the same values. None on a PyTorch
    without FSDP2's custom collectives (gloo's own then run, and the table's note says so)."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
            DefaultAllGather,
            DefaultReduceScatter,
        )
    except ImportError:  # a PyTorch without FSDP2's custom collectives
        return None

    # a group's buffer holds at most every parameter, each padded along its first dimension to
    # a multiple of the world size (FSDP2's dim-0 shards), in at most 4 bytes an element (an
    # fp32 reduction; more for a wider parameter)
    world = dist.get_world_size()

    def padded_bytes(p: torch.Tensor) -> int:
        shape = tuple(p.shape) or (1,)
        rows = -(-shape[0] // world) * world
        return rows * math.prod(shape[1:]) * max(p.element_size(), 4)

    scratch = torch.empty(sum(padded_bytes(p) for p in model.parameters()), dtype=torch.uint8)

    def in_scratch(t: torch.Tensor) -> torch.Tensor:
        size = t.numel() * t.element_size()
        if size > scratch.numel():
            raise WorkbookError(f"an FSDP buffer of {size} bytes is larger than the scratch "
                                f"buffer of the CPU measurement ({scratch.numel()} bytes)",
                                "report this: the measurement sizes it from the parameters")
        return scratch[:size].view(t.dtype)

    class AllGather(DefaultAllGather):
        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            buf = in_scratch(output_tensor).view(group.size(), -1)
            buf.zero_()
            buf[group.rank()].copy_(input_tensor.reshape(-1))
            dist.all_reduce(buf, group=group)
            output_tensor.view(-1).copy_(buf.view(-1))

    class ReduceScatter(DefaultReduceScatter):
        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            buf = in_scratch(input_tensor)
            buf.copy_(input_tensor.view(-1))
            dist.all_reduce(buf, op=op, group=group)
            output_tensor.view(-1).copy_(buf.view(group.size(), -1)[group.rank()])

    return AllGather(), ReduceScatter()


GLOO_NOTE = ("this PyTorch has no FSDP2 custom collectives (set_custom_all_gather): gloo's "
             "own ran, whose temporaries NCCL does not make - the backward and later update "
             "can read above the prediction here")


def _measure_without_gloo_temporaries(model: nn.Module) -> bool:
    """Give every FSDP module `_collectives_in_place`; False (and nothing changed) when this
    PyTorch cannot."""
    from torch.distributed.fsdp import FSDPModule

    sharded = [m for m in model.modules() if isinstance(m, FSDPModule)]
    comms = _collectives_in_place(model)
    if comms is None or not all(hasattr(m, "set_custom_all_gather") and
                                hasattr(m, "set_custom_reduce_scatter") for m in sharded):
        return False
    for module in sharded:
        module.set_custom_all_gather(comms[0])
        module.set_custom_reduce_scatter(comms[1])
    return True


def measured_phases(task: Task, cfg, batches: tuple[Batch, list[Batch], Batch],
                    device: torch.device, scratch: Path) -> tuple[dict[str, int], str]:
    """Per-rank peak live bytes of every training phase (notebook 03's workload, each phase
    from what the previous left) and of a DCP save of the model and optimizer, on a freshly
    built sharded model. On the CPU the profiler's allocation events; on CUDA the allocator's
    counters. With a note when the measurement differs from what the prediction models."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    seed_everything(cfg.seed)
    model = shard_model(task, task.build_model().to(device), cfg.shape.precision)
    note = "" if device.type != "cpu" or _measure_without_gloo_temporaries(model) else GLOO_NOTE
    stepper = build_stepper(task, cfg, model)
    multi_tensor_step(stepper.optimizer)  # as the prediction
    batch, group, eval_batch = batches
    group = group[:2]  # as the prediction: from the second on, micro-batches repeat the state
    work = Workload(stepper, batch.to(device), [b.to(device) for b in group],
                    eval_batch.to(device), targets_of(task, batch),
                    sum(targets_of(task, b) for b in group))
    peaks, live = {}, 0
    for phase in TRAINING_PHASES:
        if phase != "backward":  # what lives now is all reachable: count it
            held_now = [t for t in work.state.values() if isinstance(t, torch.Tensor)]
            live = live_bytes(local_state(model, stepper.optimizer,
                                          [*work.tensors(), *held_now]))
        # else: forward's end (its saved activations are in the autograd graph, not reachable;
        # the profiler saw them allocated)
        with measure(device) as held:
            work.run(phase)
        reading = rebased(held.reading, live)
        live, peaks[phase] = reading.allocated_bytes, reading.peak_allocated_bytes
    work.state.clear()
    gc.collect()  # as the prediction: what the training phases left unreachable is gone
    live = live_bytes(local_state(model, stepper.optimizer, work.tensors()))
    with measure(device) as held:
        msd, osd = get_state_dict(model, stepper.optimizer)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(scratch))
        del msd, osd
    peaks[CHECKPOINT_SAVE] = rebased(held.reading, live).peak_allocated_bytes
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(scratch, ignore_errors=True)
    return peaks, note


# --- the launches -----------------------------------------------------------------------------
def run_sharded(spec: ShardedSpec, out: Path, resume_from: Path | None = None) -> None:
    """The body of one process of an FSDP launch (torchrun set RANK, WORLD_SIZE, LOCAL_RANK)."""
    def body(rank: int, world: int, device: torch.device, audit: WriteAudit) -> dict[str, Any]:
        task = load_task(spec.task, **spec.task_options)
        work = _resume if resume_from is not None else _train
        return {**work(spec, task, out, resume_from, rank, world, device, audit),
                "spec": asdict(spec), "world": world, "backend": dist.get_backend()}

    in_launch(spec, out / RESULT, body)


def _first_updates(task: Task, items: list[Item], spec: ShardedSpec, world: int,
                   n: int) -> list[list[tuple[list, list]]]:
    """Every rank's micro-batches and weights of the first `n` updates (a pure function of the
    seed: any rank can compute the others')."""
    out = []
    for r in range(world):
        stream = replica_updates(task, items, spec, r, world)
        out.append([next(stream)[1:] for _ in range(n)])
    return out


def _train(spec: ShardedSpec, task: Task, out: Path, resume_from: Path | None, rank: int,
           world: int, device: torch.device, audit: WriteAudit) -> dict[str, Any]:
    data, cfg = spec.prepared(task)
    items, val = data.train, data.validation or data.train
    result: dict[str, Any] = {}
    times: dict[str, float] = {}
    if spec.memory:
        t = now(device)
        batches = sized_batches(task, items, val, Plan(spec.shape, spec.plan_length or None,
                                                       spec.eval_batch,
                                                       spec.plan_eval_length or None))
        peaks, result["memory_note"] = measured_phases(task, cfg, batches, device,
                                                       out / ".memory-probe")
        result["memory"] = gather(peaks)
        times["memory"] = now(device) - t
    if not spec.train:
        return {**result, "times": gather(times)}
    seed_everything(spec.seed)
    base = task.build_model().to(device)
    groups = ckpt.tied_groups(base)
    result.update({"init_digest": gather(digest(base.state_dict())), "tied_groups": groups,
                   "blocks": len(blocks(task, base))})
    # the first updates against one process, and the planted tie, on the same examples
    t = now(device)
    k = min(spec.compare_updates, spec.updates)
    shares = _first_updates(task, items, spec, world, k)
    compared = {"clean": compared_run(task, base, cfg, shares[rank], world, groups, False)}
    if spec.plant and groups:
        compared["tie_after_shard"] = compared_run(task, base, cfg, shares[rank], world, groups,
                                                   True)
    if rank == 0:
        real = [[[b for b, w in zip(*shares[r][u], strict=True) if w] for r in range(world)]
                for u in range(k)]
        ref = reference_updates(task, base, cfg, real)
        result["first_updates"] = {
            "updates": k, "reference_losses": ref["losses"],
            "runs": {name: {"losses": c["losses"],
                            "gradient_deviation": relative_deviation(c["gradient"],
                                                                     ref["gradient"]),
                            "missing_gradients": sorted(set(ref["gradient"]) -
                                                        set(c["gradient"])),
                            "parameter_deviation": relative_deviation(c["params"],
                                                                      ref["params"]),
                            "forwards_checked": c["forwards_checked"],
                            "split_groups": c["split_groups"],
                            "saved_tie_difference": c["saved_tie_difference"]}
                     for name, c in compared.items()}}
    del compared
    times["first updates"] = now(device) - t
    # the training run, with the sharded checkpoint
    seed_everything(spec.seed)
    model = shard_model(task, copy.deepcopy(base), cfg.shape.precision)
    stepper = build_stepper(task, cfg, model)
    records, checkpoint = _steps(spec, task, items, stepper, Position(), 1, rank, world, device,
                                 out, audit)
    sync_batch_norm(model, world)  # the final weights hold every rank's statistics
    params, optim = full_state(model, stepper.optimizer)
    if rank == 0:
        write_file(out / WEIGHTS, lambda tmp: save_file(params, str(tmp)), "final weights")
    times["training"] = sum(r["seconds"] for r in records)
    result.update({"records": gather(records), "checkpoint": checkpoint,
                   "final_digest": digest(params) if rank == 0 else None,
                   "times": gather(times), "first_step": 1})
    return result


def _steps(spec: ShardedSpec, task: Task, items: list[Item], stepper: Stepper,
           start: Position, first: int, rank: int, world: int, device: torch.device,
           out: Path, audit: WriteAudit) -> tuple[list[dict], dict | None]:
    stream = replica_updates(task, items, spec, rank, world, start)
    records, checkpoint = [], None
    for step in range(first, spec.updates + 1):
        where, batches, weights = next(stream)
        lr = stepper.optimizer.param_groups[0]["lr"]
        t = now(device)
        row = sharded_update(stepper, batches, weights, world)
        real = [b for b, w in zip(batches, weights, strict=True) if w]
        records.append({"step": step, "epoch": where.epoch, "group": where.group, "lr": lr,
                        **row, "seconds": now(device) - t,
                        "ids": [str(i) for b in real for i in b.ids]})
        if step == spec.checkpoint_at:
            checkpoint = _checkpoint(spec, stepper, step, Position(where.epoch, where.group + 1),
                                     rank, world, device, out, audit)
    return records, checkpoint


def _checkpoint(spec: ShardedSpec, stepper: Stepper, step: int, after: Position, rank: int,
                world: int, device: torch.device, out: Path,
                audit: WriteAudit) -> dict[str, Any]:
    """Every rank writes its shard of one DCP checkpoint (with `plant`, rank 0 alone also
    writes one the classic way); the whole state's digests say what a resume must restore.
    Batch-norm running statistics are averaged over the ranks first, as the DDP loop does:
    FSDP2 leaves buffers unsharded, each rank's own, and DCP keeps one rank's copy of them."""
    sync_batch_norm(stepper.model, world)
    rngs = gather(ckpt.rng_state())
    trainer = {"step": step, "epoch": after.epoch, "group": after.group, "world": world,
               "scheduler": stepper.scheduler.state_dict(), "rank_rng": rngs}
    name = f"ckpt-{step:06d}"
    written = {}
    t = now(device)
    save_sharded(out / name, stepper, trainer)
    seconds = now(device) - t
    written[name] = gather(audit.under(name))
    if spec.plant:
        planted = PLANTED_PREFIX + name
        save_sharded(out / planted, stepper, trainer, rank0_only=True)
        written[planted] = gather(audit.under(planted))
    params, optim = full_state(stepper.model, stepper.optimizer)
    info = {"path": name, "seconds": seconds, "written": written}
    if rank == 0:
        info.update({"model_digest": digest(params), "optim_digest": digest(optim),
                     "coverage": {n: coverage(out / n) for n in written}})
    return info


def _resume(spec: ShardedSpec, task: Task, out: Path, resume_from: Path, rank: int, world: int,
            device: torch.device, audit: WriteAudit) -> dict[str, Any]:
    """New processes: load the planted checkpoint (when given) into a fresh sharded model and
    see what it restores, then the checkpoint itself, and continue to the last update."""
    data, cfg = spec.prepared(task)
    items = data.train

    def fresh() -> Stepper:
        seed_everything(spec.seed)
        return build_stepper(task, cfg, shard_model(task, task.build_model().to(device),
                                                   cfg.shape.precision))

    stepper = fresh()
    trainer = load_sharded(resume_from, stepper)
    check_world(resume_from, int(trainer["world"]), world)
    params, optim = full_state(stepper.model, stepper.optimizer)
    result: dict[str, Any] = {}
    if rank == 0:
        result["restored"] = {"model_digest": digest(params), "optim_digest": digest(optim)}
    if spec.planted_checkpoint:
        result["planted_load"] = _planted_load(Path(spec.planted_checkpoint), fresh, stepper,
                                               rank)
    stepper.scheduler.load_state_dict(trainer["scheduler"])
    ckpt.set_rng_state(trainer["rank_rng"][rank])
    first = int(trainer["step"]) + 1
    records, _ = _steps(spec, task, items, stepper, Position(int(trainer["epoch"]),
                                                               int(trainer["group"])), first,
                        rank, world, device, out, audit)
    sync_batch_norm(stepper.model, world)
    params, _ = full_state(stepper.model)
    if rank == 0:
        write_file(out / WEIGHTS, lambda tmp: save_file(params, str(tmp)), "final weights")
    result.update({"records": gather(records), "first_step": first,
                   "final_digest": digest(params) if rank == 0 else None})
    return result


def _planted_load(path: Path, fresh, restored: Stepper, rank: int) -> dict[str, Any]:
    """Load the rank-0-only checkpoint into a fresh sharded model: the error it raises, or how
    far each rank's shards are from those the real checkpoint restored."""
    other = fresh()
    try:
        load_sharded(path, other)
    except Exception as exc:  # DCP raises on every rank alike (its plans are exchanged)
        return {"error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"}
    mine = {n: local_tensor(p).detach() for n, p in other.model.named_parameters()}
    theirs = {n: local_tensor(p).detach() for n, p in restored.model.named_parameters()}
    off = gather(max_difference(mine, theirs))
    return {"rank_max_difference": off}


def main(data: dict[str, Any], out: str, resume_from: str | None) -> int:
    """`python -m workbook ddp` with an FSDP spec: one process of an FSDP launch."""
    spec = ShardedSpec.from_dict(data)
    run_sharded(spec, Path(out), Path(resume_from) if resume_from else None)
    return 0
