"""Per-GPU memory of FSDP2 full sharding over N GPUs, predicted on one CPU: the campaign model is
built on fake tensors (shapes and dtypes, no storage), `fully_shard` is applied per block and on
the root over a fake process group of N ranks (`torch.testing._internal.distributed.fake_pg`:
collectives do nothing, their buffers are allocated as on a GPU), and the training phases of
`workload` run under a subclass of PyTorch's `FSDPMemTracker` that keeps one peak per
phase. Nothing of the campaign model is ever allocated.

A deep campaign model (`campaign.Deep`, or a `transformers` config) is not run at its depth: the
sharded step runs at 3 and 4 layers with every operator's bytes recorded by kind and layer, and
each operator is carried to the full depth as the single-device prediction carries it
(`traces.carried`); FSDP2's loops over the parameters outside the layer stack (the
optimizer's state, made parameter by parameter) are paired operator for operator
(`sharded_tracker._paired`, beside the tracker and the rest of the trace arithmetic).
Equal to the byte to the run at the full depth (tests/training/test_sharding.py, and
`benchmarks/campaign_scale.py --against-full-depth` for 7 B and 70 B); a phase whose traces do
not line up is run at the full depth, and `ShardedRun.sized` says how the depth was sized.

What the prediction does not see: the CUDA context and the caching allocator (the rental sheet
adds them as stated overheads), NCCL's own buffers, and the overlap of the next layer's
all-gather with the current layer's compute (FSDP2 prefetches one block ahead on a GPU stream;
under the fake process group every collective finishes at once, so at most one block's
prefetch is missing from a peak - the size of one block's unsharded parameters)."""

from __future__ import annotations

import contextlib
import gc
import math
import warnings
from dataclasses import dataclass, field, replace
from typing import Any

import pandas as pd
import torch
from torch import nn

from ..base.errors import WorkbookError, reason
from ..contract.data import Batch, Item
from ..contract.shape import MAX_WORLD, MIN_WORLD
from ..contract.task import Task
from . import campaign as models
from . import traces
from .fake_phases import fake_batch, fake_model
from .loop import TrainConfig, build_stepper
from .predict import Plan, calibration_limits, check_length, path_limits, sized_batches
from .sharded_model import blocks, shard_model
from .sharded_tracker import (
    carried_sharded,
    fixed_and_sharded,
    gpu_bytes,
    traced_breakdown,
    tracker_class,
)
from .workload import (
    CHECKPOINT_SAVE,
    SHARDED_PHASES,
    TRAINING_PHASES,
    Workload,
    multi_tensor_step,
    targets_of,
)

WORLDS = (2, 4, 8, 16, 32, 64)  # the GPU counts a candidate without one is sized at


def check_world(world: Any) -> int:
    """The GPU count of an FSDP group: an integer from 2 to 64."""
    if isinstance(world, bool) or not isinstance(world, int) or not \
            MIN_WORLD <= world <= MAX_WORLD:
        raise WorkbookError(
            f"world {world!r}: FSDP full sharding is sized over {MIN_WORLD} to {MAX_WORLD} GPUs "
            f"(an integer)", "give world=2..64; one GPU is the single-device strategy "
            "(workbook.predict.predict)" if world in (0, 1) else
            f"give world={MIN_WORLD}..{MAX_WORLD} (several nodes: gpus_per_node in the "
            "candidate)")
    return world


def no_blocks(task: Task, model: nn.Module, campaign: bool) -> WorkbookError:
    return WorkbookError(
        f"FSDP full sharding needs blocks to shard one by one, and {type(model).__name__} "
        f"({models.which(task, campaign)}) has none: no nn.ModuleList, no Hugging Face "
        "_no_split_modules, no Task.checkpoint_blocks",
        "set Task.checkpoint_blocks to a function that picks the repeated blocks (e.g. lambda "
        "m: isinstance(m, MyLayer)), or plan data parallel instead")


@contextlib.contextmanager
def fake_world(world: int):
    """A fake process group of `world` ranks (this process is rank 0) and its device mesh, torn
    down afterwards whatever happens. Refused when a process group already exists (inside a
    torchrun worker): sizing needs its own."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_available() and dist.is_initialized():
        raise WorkbookError(
            "a default process group is already initialised in this process (a torchrun "
            "worker?): the sharded prediction makes its own fake one of the world size it sizes",
            "size from a process without one (the notebook, or `python -c` beside the job), or "
            "call dist.destroy_process_group() first")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        # the mesh before the fake mode: made in it, its rank tensor would be fake
        yield init_device_mesh("cpu", (world,))
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def young_objects_only():
    """The run's `gc.collect()` calls walk only what was made since it began: what lived before
    (a notebook's or a test session's whole heap) is frozen meanwhile (`gc.freeze`), and each
    collection then costs what the run made, not the process (a quarter of a second each in
    a test session). Left as it is where something is frozen already (a forked worker)."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@dataclass
class ShardedRun:
    """One fake run at `world` ranks: each phase's per-GPU peak and breakdown, and per phase
    the (fixed, sharded) bytes of every operator, from which `at(n)` gives another world size.
    A phase carried from shallow traces (`sized`) keeps them (`carry`) and the (fixed,
    sharded) bytes of the operators that can hold its peak."""

    config: str
    model: str
    world: int
    offload: bool
    phases: dict[str, dict]  # phase -> {"peak": int, "breakdown": {...}, "points": [(f, s)]}
    limits: dict[str, str] = field(default_factory=dict)  # phase -> why it is not predicted
    sized: str = "run at its full depth"  # how the model's depth was sized

    def at(self, world: int) -> pd.DataFrame:
        """The per-GPU prediction at `world`, exact at the run's own world size and derived for
        another (the sharded state scaled as 1/N, operator by operator; FSDP2 pads each
        parameter's first dimension to a multiple of N, which this leaves out)."""
        world = check_world(world)
        rows = []
        for phase, data in self.phases.items():
            if world == self.world:
                peak, how = data["peak"], ""
            else:
                scale = self.world / world
                if "carry" in data:  # the operators carried again, the largest at this world
                    on_gpu = gpu_bytes(self.offload, scale)
                    peak = max(map(on_gpu, carried_sharded(data["carry"], on_gpu)))
                else:
                    peak = max(f + (0 if self.offload else round(s * scale))
                               for f, s in data["points"])
                how = (f"derived from the fake run at {self.world} GPUs: the sharded state "
                       "scaled as 1/N per operator")
            note = "; ".join(n for n in (data.get("note", ""), how) if n)
            if phase in self.limits:
                peak, note = float("nan"), f"not predicted: {self.limits[phase]}"
            rows.append({"config": self.config, "model": self.model, "world": world,
                         "phase": phase, "predicted_peak_bytes": peak,
                         "breakdown": data["breakdown"] if world == self.world else
                         {**data["breakdown"], "derived_from_world": self.world},
                         "note": note})
        frame = pd.DataFrame(rows)
        frame.attrs["sized"] = self.sized
        return frame


def sharded_run(task: Task, train: list[Item], val: list[Item], plan: Plan, world: int, *,
                offload_optimizer: bool = False, campaign: bool = True) -> ShardedRun:
    """The fake run behind `predict_sharded` (see there). A deep campaign model
    (`campaign.depth_of`) is run sharded at `traces.TRACE_DEPTHS` layers with every
    operator's memory recorded by kind and layer, and each phase's operators are carried to
    the full depth (`traces.carried`, as the single-device prediction does); a phase whose
    two traces do not line up layer for layer is taken from a run at the full depth."""
    world = check_world(world)
    if plan.shape.replicas != 1:
        raise WorkbookError(f"plan {plan.label()} has replicas={plan.shape.replicas}: under "
                            "FSDP every one of the world's GPUs is a data-parallel rank",
                            "give replicas=1 and the GPU count as world")
    campaign = campaign and models.declared(task)
    if campaign:
        models.check_twin(task)
    check_length(task, plan, campaign)
    meta = models.on_meta(models.factory(task, campaign))
    if not blocks(task, meta):
        raise no_blocks(task, meta, campaign)
    del meta
    batch, group, eval_batch = sized_batches(task, train, val, plan)
    # the phases fake tensors would size on another path than real ones take, and those the
    # real run of the twin (the campaign's layers) says a kernel hides memory from
    limits = {**calibration_limits(task, train, val, plan, "cpu", False),
              **path_limits(task, batch, group, eval_batch)}
    which = models.which(task, campaign)
    if any(phase in limits for phase in TRAINING_PHASES[:-1]):
        # a training phase cannot be predicted: the fit cannot rest on this run, so it is not
        # made (rows without bytes, with the reason)
        blank = {phase: {"peak": 0, "breakdown": {}, "points": [(0, 0)]}
                 for phase in SHARDED_PHASES}
        return ShardedRun(plan.label() + f" fsdp x{world}", which, world,
                          offload_optimizer, blank,
                          {**limits, CHECKPOINT_SAVE: "the training phases were not predicted"},
                          sized="not run")
    # update (later): every micro-batch after the first starts from the same live state (the
    # update's gradients allocated, batches of the same planned shape), so one such micro-batch
    # and the step stand for the whole update (`_update_later`)
    group = group[:2]
    label = plan.label() + f" fsdp x{world}" + (" +offload" if offload_optimizer else "")
    run = _FakeRun(plan, world, batch, group, eval_batch, targets_of(task, batch),
                   sum(targets_of(task, b) for b in group), offload_optimizer, campaign, label)
    deep = models.depth_of(task) if campaign else None
    phases: dict[str, dict] | None = None
    sized = "run at its full depth"
    if deep is not None:
        traced = {}
        for n in traces.TRACE_DEPTHS:
            traced[n] = run.phases(replace(task, campaign_model=deep.with_layers(n)), layers=n)
            if traced[n] is None:  # no one layer stack of n blocks of one type
                break
        else:
            phases, missing = _carry(traced, deep.layers, offload_optimizer)
            sized = (f"each operator's memory carried from sharded fake runs at "
                     f"{' and '.join(map(str, traces.TRACE_DEPTHS))} layers to {deep.layers}")
            if missing:
                full = run.phases(task)
                phases = {p: full[p] if p in missing else phases[p] for p in SHARDED_PHASES}
                sized += (f"; {', '.join(missing)} run at the full depth (the shallow runs "
                          "did not line up layer for layer)")
    if phases is None:
        phases = run.phases(task)
        if deep is not None:
            sized += " (the shallow runs have no layer stack of one module type)"
    phases[CHECKPOINT_SAVE]["note"] = CHECKPOINT_NOTE
    if offload_optimizer:
        host = phases["update (first)"]["breakdown"].get("sharded_state_in_host_memory", 0)
        for data in phases.values():
            data["note"] = "; ".join(n for n in (data.get("note", ""), (
                f"optimizer offload: the sharded parameters, gradients and optimizer state "
                f"({host / 2**30:.2f} GiB per rank at the first update) are in host "
                "memory and the optimizer steps on the CPU")) if n)
    return ShardedRun(label, which, world, offload_optimizer, phases, limits, sized=sized)


def _carry(traced: dict[int, dict], depth: int, offload: bool) -> tuple[dict, list[str]]:
    """Each phase at `depth` layers from its sharded traces at `traces.TRACE_DEPTHS` layers: its
    operators carried (`traces.carried`), the peak the largest of them on one GPU, its
    breakdown that operator's. Every phase is carried, the root's all-gather, the optimizer step
    and the checkpoint save included: outside the layer stack each is an operator whose memory
    is linear in the depth (the root's parameters do not grow with it; the sharded state grows
    by one layer's shards per layer). The stretches outside the stack whose length grows with
    the depth are paired operator for operator (`sharded_tracker._paired`), not carried by
    their largest operator at 3 and 4 layers as the single-device prediction does: for a 70 B
    Llama over 8 GPUs the later update's largest operator after the backward is the backward's
    end at 3 and 4 layers and the optimizer's temporaries at 80, and the largest-operator carry
    was 6.7% low.
    Returns the phases and those whose traces do not line up (run at the full depth)."""
    shallow, deeper = (traced[n] for n in traces.TRACE_DEPTHS)
    on_gpu = gpu_bytes(offload)
    phases, missing = {}, []
    for phase in SHARDED_PHASES:
        pair = (traces.attach_gaps(shallow[phase]["trace"]),
                traces.attach_gaps(deeper[phase]["trace"]), depth)
        candidates = carried_sharded(pair, on_gpu)
        if candidates is None:
            missing.append(phase)
            continue
        top = max(candidates, key=on_gpu)
        phases[phase] = {"peak": on_gpu(top), "breakdown": traced_breakdown(top, offload),
                         "points": [fixed_and_sharded(c) for c in candidates],
                         "carry": pair}
    return phases, missing


@dataclass
class _FakeRun:
    """What every fake sharded run of one sizing shares: the plan, the world, the batches."""

    plan: Plan
    world: int
    batch: Batch
    group: list[Batch]
    eval_batch: Batch
    targets: int
    group_targets: int
    offload: bool
    campaign: bool
    label: str

    def phases(self, task: Task, layers: int | None = None) -> dict[str, dict] | None:
        """Each phase's per-GPU peak, breakdown and (fixed, sharded) bytes per operator of
        `task`'s model run sharded on fake tensors; with `layers` (the model's depth), every
        operator's memory by kind (`sharded_tracker.TRACE_KINDS`) with its layer, as `trace`
        (None when the sharded model has no one stack of `layers` blocks of one type)."""
        from torch._subclasses.fake_tensor import FakeTensorMode

        from .loop import apply_activation_checkpointing

        plan, campaign, label = self.plan, self.campaign, self.label
        cfg = TrainConfig(plan.shape, device="cpu")
        plain = TrainConfig(replace(plan.shape, activation_checkpointing=False), device="cpu")
        phases: dict[str, dict] = {}
        with young_objects_only(), fake_world(self.world) as mesh, \
                FakeTensorMode(allow_non_fake_inputs=False) as fake, warnings.catch_warnings():
            # FSDP2 warns of a root output that is a view (an in-place op on it would skip the
            # all-gather); the workload never writes into the model's outputs
            warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
            model = fake_model(task, cfg, fake, campaign)
            if plan.shape.activation_checkpointing:
                apply_activation_checkpointing(task, model)
            if not blocks(task, model):
                raise no_blocks(task, model, campaign)
            shard_model(task, model, plan.shape.precision, mesh, self.offload)
            # named as the tracker names modules, after sharding changed the classes
            stack = traces.layer_list(model, layers) if layers is not None else None
            if layers is not None and stack is None:
                return None
            stepper = build_stepper(task, plain, model)
            multi_tensor_step(stepper.optimizer)

            def to_fake(b: Batch) -> Batch:
                return fake_batch(fake, b, torch.device("cpu"))
            work = Workload(stepper, to_fake(self.batch), [to_fake(b) for b in self.group],
                            to_fake(self.eval_batch), self.targets, self.group_targets)
            tracker = tracker_class()(stepper.model, stepper.optimizer, self.offload, stack)
            tracker.track_inputs(tuple(work.tensors()))
            with tracker:
                for phase in SHARDED_PHASES:
                    tracker.begin()
                    try:
                        if phase == CHECKPOINT_SAVE:
                            _checkpoint_save(work, tracker)
                        elif phase == "update (later)":
                            _update_later(work, tracker)
                        else:
                            work.run(phase)
                    except WorkbookError:
                        raise
                    except Exception as exc:
                        raise WorkbookError(
                            f"predicting {phase} for {label} failed: an operation of this "
                            f"model does not run sharded on fake tensors ({reason(exc, 300)})",
                            "size this configuration by measuring it on the rental (notebook "
                            "09 runs the loop under FSDP2 on 2 CPU processes)") from exc
                    phases[phase] = {"peak": tracker.phase_peak,
                                     "breakdown": dict(tracker.phase_snapshot),
                                     "points": tracker.points,
                                     **({"trace": tracker.trace} if stack else {})}
            del work, stepper, model, tracker
            gc.collect()
        return phases


CHECKPOINT_NOTE = ("a torch.distributed.checkpoint sharded save after the evaluation, each rank "
                   "writing its own shards: get_state_dict reads the shards without copies (and "
                   "reshards the root the evaluation left gathered) and the writer copies each "
                   "shard to host memory, so the GPU peak is what lives when the save starts; "
                   "the host copies and DCP's pickled save plans (kilobytes) are not counted")


def _update_later(work: Workload, tracker) -> None:
    """A later update, as its costliest micro-batch: with accumulation, every micro-batch but
    the first finds the update's sharded gradients already there, so they are made first (as
    the first micro-batch leaves them) and one micro-batch runs, then the step. Without
    accumulation the one micro-batch runs from no gradients, as in the loop."""
    from torch.distributed._tools.fsdp2_mem_tracker import _FSDPRefType

    if len(work.group) > 1:
        # made out of the tracker's sight and then counted as sharded gradients (made in its
        # sight, each would be an activation for an operator first): the bytes only grow here,
        # so the next operator sees this loop's peak
        tracker.quiet += 1
        try:
            for p in work.stepper.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                    local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                    tracker._update_and_maybe_create_winfos(local, _FSDPRefType.SHARDED_GRAD)
        finally:
            tracker.quiet -= 1
    loss_sum, _ = work.stepper.accumulate(work.group[-1:], work.group_targets)
    work.state["later_loss"] = loss_sum
    work.state["grad_norm"] = work.stepper.step()


def _checkpoint_save(work: Workload, tracker) -> None:
    """The checkpoint phase: what a DCP save holds on the GPU between two updates (see
    CHECKPOINT_NOTE). The outputs the other phases keep for inspection are dropped first."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    work.state.clear()
    gc.collect()
    tracker.begin()
    model, optimizer = work.stepper.model, work.stepper.optimizer
    model_state, optim_state = get_state_dict(model, optimizer)
    del model_state, optim_state


def predict_sharded(task: Task, train: list[Item], val: list[Item], plan: Plan, world: int, *,
                    offload_optimizer: bool = False, campaign: bool = True) -> pd.DataFrame:
    """Predicted peak bytes on one GPU of an FSDP2 group of `world` GPUs (2..64), per phase -
    the training phases of `workload` (forward + loss, backward, first update, later
    update, validation at the plan's eval shape) and a checkpoint save (`CHECKPOINT_NOTE`) - on
    fake tensors under a fake process group of that world size; the campaign model when the
    task declares one (`campaign`), never allocated.

    The model: `fully_shard` per block (`blocks`) and on the root, activation checkpointing on
    the same blocks when the plan has it, bf16 parameters and gradient reduction
    (`MixedPrecisionPolicy`) when the plan's precision is bf16 (the autocast of the workbook's
    step stays), and with `offload_optimizer` FSDP2's `CPUOffloadPolicy` (sharded parameters,
    gradients and optimizer state in host memory; the per-GPU peak leaves them out, the note
    says how much the host holds). `plan.shape.micro_batch` and `accumulation` are per GPU.
    Columns: config, model, world, phase, predicted_peak_bytes, breakdown (bytes by kind at the
    phase's peak), note. Refused when a process group already exists in this process."""
    return sharded_run(task, train, val, plan, world, offload_optimizer=offload_optimizer,
                       campaign=campaign).at(world)


def predict_sharded_worlds(task: Task, train: list[Item], val: list[Item], plan: Plan,
                           worlds: tuple[int, ...] = WORLDS, *, offload_optimizer: bool = False,
                           campaign: bool = True, at: int | None = None) -> pd.DataFrame:
    """`predict_sharded` for several world sizes from one fake run (at `at`, default the
    smallest): exact there, derived for the others (`ShardedRun.at`)."""
    worlds = tuple(check_world(w) for w in worlds)
    run = sharded_run(task, train, val, plan, at or min(worlds),
                      offload_optimizer=offload_optimizer, campaign=campaign)
    frame = pd.concat([run.at(w) for w in worlds], ignore_index=True)
    frame.attrs["sized"] = run.sized
    return frame


def nodes(world: int, gpus_per_node: int) -> int:
    """Nodes a world of `world` GPUs takes at `gpus_per_node` each."""
    return math.ceil(world / gpus_per_node)


def per_gpu_split(micro_batch: int, accumulation: int, world: int) -> tuple[int, int] | None:
    """An update of micro_batch x accumulation examples split over `world` GPUs: (micro-batch,
    accumulation) per GPU with the same examples per update, the largest micro-batch not above
    `micro_batch`; None when the examples do not split evenly over `world`."""
    total = micro_batch * accumulation
    if total % world:
        return None
    each = total // world
    micro = max(d for d in range(1, min(micro_batch, each) + 1) if each % d == 0)
    return micro, each // micro


