"""Per-GPU memory of FSDP2 full sharding over N GPUs, predicted on one CPU: the campaign model is
built on fake tensors (shapes and dtypes, no storage), `fully_shard` is applied per block and on
the root over a fake process group of N ranks (`torch.testing._internal.distributed.fake_pg`:
collectives do nothing, their buffers are allocated as on a GPU), and the training phases of
`workbook.workload` run under a subclass of PyTorch's `FSDPMemTracker` that keeps one peak per
phase. Nothing of the campaign model is ever allocated.

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

from . import campaign as models
from .data import Batch, Item
from .errors import WorkbookError, reason
from .loop import build_stepper
from .predict import (
    Plan,
    calibration_limits,
    check_length,
    fake_batch,
    fake_model,
    path_limits,
    sized_batches,
)
from .sharded_replica import blocks
from .task import Task
from .workload import TRAINING_PHASES, Workload, targets_of

CHECKPOINT_SAVE = "checkpoint save"
SHARDED_PHASES = (*TRAINING_PHASES, CHECKPOINT_SAVE)
WORLDS = (2, 4, 8, 16, 32, 64)  # the GPU counts a candidate without one is sized at
MIN_WORLD, MAX_WORLD = 2, 64
BREAKDOWN = ("sharded_state", "unsharded_params", "unsharded_grads", "activations", "temporaries",
             "collective_buffers", "buffers_and_inputs")


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


def _tracker_class():
    """The phase tracker, made on first use (the FSDP tools import torch.distributed)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType

    sharded = (_FSDPRefType.SHARDED_PARAM, _FSDPRefType.SHARDED_GRAD, _FSDPRefType.OPT)
    groups = {"sharded_state": sharded,
              "unsharded_params": (_FSDPRefType.UNSHARDED_PARAM,),
              "unsharded_grads": (_FSDPRefType.UNSHARDED_GRAD,),
              "activations": (_FSDPRefType.ACT,), "temporaries": (_FSDPRefType.TEMP,),
              "collective_buffers": (_FSDPRefType.ALL_GATHER, _FSDPRefType.REDUCE_SCATTER),
              "buffers_and_inputs": (_FSDPRefType.BUFFER, _FSDPRefType.INP)}

    class ShardedPhaseTracker(FSDPMemTracker):
        """FSDPMemTracker with a peak per phase of the bytes one GPU holds, and each phase's
        memory as (bytes that do not depend on the world size, bytes of the sharded state)
        per operator, so other world sizes follow from one run (the sharded state - sharded
        parameters, their gradients, the optimizer state and its step's temporaries - scales
        as 1/N; activations, unsharded parameters and gradients and the collectives' full-size
        buffers do not). With `offload` the sharded state lives in host memory (FSDP2's
        CPUOffloadPolicy) and is not on the GPU."""

        def __init__(self, model: nn.Module, optimizer, offload: bool):
            super().__init__(model, optimizer)
            self.offload = offload
            self.phase_peak, self.phase_snapshot, self.points = 0, {}, []
            self.quiet = 0

        def _split(self) -> tuple[int, int]:
            fixed = shard = 0
            for snap in self._curr_mem_snap.values():
                s = sum(snap.get(k, 0) for k in sharded)
                shard += s
                fixed += snap.get("Total", 0) - s
            return fixed, shard

        def on_gpu(self) -> int:
            fixed, shard = self._split()
            return fixed if self.offload else fixed + shard

        def begin(self) -> None:
            self.points = [self._split()]
            self.phase_peak = self.on_gpu()
            self.phase_snapshot = self._merged()

        def _merged(self) -> dict[str, int]:
            out = {}
            for name, keys in groups.items():
                out[name] = sum(int(snap.get(k, 0)) for snap in self._curr_mem_snap.values()
                                for k in keys)
            if self.offload:
                out["sharded_state_in_host_memory"] = out.pop("sharded_state")
            return out

        def add_point(self, fixed: int, shard: int) -> None:
            """A moment the tracker does not see (a modelled allocation)."""
            self.points.append((fixed, shard))
            on_gpu = fixed if self.offload else fixed + shard
            if on_gpu > self.phase_peak:
                self.phase_peak = on_gpu
                self.phase_snapshot = {**self._merged(), "modelled": on_gpu - self.on_gpu()}

        def _update_peak_stats(self, peak_state) -> None:
            # the stock tracker scans every module's statistics per operator (a weak dict of
            # modules: most of a 7 B step's time); only the phase peaks are read here
            point = self._split()
            self.points.append(point)
            on_gpu = point[0] if self.offload else point[0] + point[1]
            if on_gpu > self.phase_peak:
                self.phase_peak = on_gpu
                self.phase_snapshot = self._merged()

        def __enter__(self):
            # DTensor's sharding propagation runs each optimizer-step op once more on fake
            # tensors of the global (unsharded) shape, in the active fake mode: shapes only,
            # never allocated on a GPU, so not tracked (else a clip_grad_norm_ over a 7 B
            # model's gradients counts its whole unsharded size)
            from torch.distributed.tensor._sharding_prop import ShardingPropagator

            if self._depth == 0:
                # and DTensor caches its sharding propagation (off when it sees a fake mode, for
                # symbolic shapes; these shapes are all concrete)
                from torch.distributed.tensor import _dispatch

                self._saved_tracing = _dispatch._are_we_tracing
                _dispatch._are_we_tracing = lambda: False
                original = ShardingPropagator._propagate_tensor_meta_non_cached
                tracker = self

                def quiet(prop, op_schema):
                    tracker.quiet += 1
                    try:
                        return original(prop, op_schema)
                    finally:
                        tracker.quiet -= 1
                self._saved_propagation = original
                ShardingPropagator._propagate_tensor_meta_non_cached = quiet
            return super().__enter__()

        def __exit__(self, *args):
            from torch.distributed.tensor._sharding_prop import ShardingPropagator

            super().__exit__(*args)
            if self._depth == 0:
                from torch.distributed.tensor import _dispatch

                ShardingPropagator._propagate_tensor_meta_non_cached = self._saved_propagation
                _dispatch._are_we_tracing = self._saved_tracing

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if self.quiet:
                return func(*args, **(kwargs or {}))
            return super().__torch_dispatch__(func, types, args, kwargs)

        def _fsdp_state_pre_forward(self, fsdp_mod, orig):
            inner = super()._fsdp_state_pre_forward(fsdp_mod, orig)

            def again(*args, **kwargs):
                # the next micro-batch or the evaluation: start the module statistics afresh
                # (the stock tracker refuses a second forward of the root)
                if fsdp_mod is self._root_mod and fsdp_mod in self.memory_tracking and \
                        not self._mod_tracker.is_bw:
                    self.reset_mod_stats()
                return inner(*args, **kwargs)
            return again

    return ShardedPhaseTracker


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


@dataclass
class ShardedRun:
    """One fake run at `world` ranks: each phase's per-GPU peak and breakdown, and per phase
    the (fixed, sharded) bytes of every operator, from which `at(n)` gives another world size."""

    config: str
    model: str
    world: int
    offload: bool
    phases: dict[str, dict]  # phase -> {"peak": int, "breakdown": {...}, "points": [(f, s)]}
    limits: dict[str, str] = field(default_factory=dict)  # phase -> why it is not predicted

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
        return pd.DataFrame(rows)


def _largest_shard(model: nn.Module, optimizer) -> int:
    """Bytes of the largest local tensor of the rank's state dict (a parameter shard or an
    optimizer-state shard)."""
    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t
    sizes = [local(p).numel() * p.element_size() for p in model.parameters()]
    for state in optimizer.state.values():
        sizes += [local(v).numel() * v.element_size() for v in state.values()
                  if isinstance(v, torch.Tensor)]
    return max(sizes, default=0)


def sharded_run(task: Task, train: list[Item], val: list[Item], plan: Plan, world: int, *,
                offload_optimizer: bool = False, campaign: bool = True, lr: float = 1e-3,
                seed: int = 0) -> ShardedRun:
    """The fake run behind `predict_sharded` (see there)."""
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
    if any(phase in limits for phase in TRAINING_PHASES[:-1]):
        # a training phase cannot be predicted: the fit cannot rest on this run, so it is not
        # made (rows without bytes, with the reason)
        blank = {phase: {"peak": 0, "breakdown": {}, "points": [(0, 0)]}
                 for phase in SHARDED_PHASES}
        return ShardedRun(plan.label() + f" fsdp x{world}", models.which(task, campaign), world,
                          offload_optimizer, blank,
                          {**limits, CHECKPOINT_SAVE: "the training phases were not predicted"})
    # update (later): every micro-batch after the first starts from the same live state (the
    # update's gradients allocated, batches of the same planned shape), so one such micro-batch
    # and the step stand for the whole update (`_update_later`)
    group = group[:2]
    targets = targets_of(task, batch)
    group_targets = sum(targets_of(task, b) for b in group)
    label = plan.label() + f" fsdp x{world}" + (" +offload" if offload_optimizer else "")
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    from .loop import apply_activation_checkpointing

    cfg = plan.shape.train_config(lr=lr, seed=seed, device="cpu")
    plain = replace(plan.shape, activation_checkpointing=False).train_config(
        lr=lr, seed=seed, device="cpu")
    bf16 = plan.shape.precision == "bf16"
    options: dict[str, Any] = {}
    if bf16:
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                    reduce_dtype=torch.bfloat16)
    if offload_optimizer:
        options["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    phases: dict[str, dict] = {}
    with fake_world(world) as mesh, FakeTensorMode(allow_non_fake_inputs=False) as fake, \
            warnings.catch_warnings():
        # FSDP2 warns of a root output that is a view (an in-place op on it would skip the
        # all-gather); the workload never writes into the model's outputs
        warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
        model = fake_model(task, cfg, fake, campaign)
        if plan.shape.activation_checkpointing:
            apply_activation_checkpointing(task, model)
        found = blocks(task, model)
        if not found:
            raise no_blocks(task, model, campaign)
        for block in found:
            fully_shard(block, mesh=mesh, **options)
        fully_shard(model, mesh=mesh, **options)
        stepper = build_stepper(task, plain, model)
        for settings in stepper.optimizer.param_groups:
            # PyTorch's default on CUDA (foreach=None picks the multi-tensor step there, the
            # per-tensor one on the CPU): the rental's step and its temporaries
            if "foreach" in settings and settings["foreach"] is None:
                settings["foreach"] = True

        def to_fake(b: Batch) -> Batch:
            return fake_batch(fake, b, torch.device("cpu"))
        work = Workload(stepper, to_fake(batch), [to_fake(b) for b in group],
                        to_fake(eval_batch), targets, group_targets)
        tracker = _tracker_class()(stepper.model, stepper.optimizer, offload_optimizer)
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
                        f"predicting {phase} for {label} failed: an operation of this model "
                        f"does not run sharded on fake tensors ({reason(exc, 300)})",
                        "size this configuration by measuring it on the rental (notebook 09 "
                        "runs the loop under FSDP2 on 2 CPU processes)") from exc
                phases[phase] = {"peak": tracker.phase_peak,
                                 "breakdown": dict(tracker.phase_snapshot),
                                 "points": tracker.points}
        phases[CHECKPOINT_SAVE]["note"] = CHECKPOINT_NOTE
        if offload_optimizer:
            host = phases["update (first)"]["breakdown"].get("sharded_state_in_host_memory", 0)
            for data in phases.values():
                data["note"] = "; ".join(n for n in (data.get("note", ""), (
                    f"optimizer offload: the sharded parameters, gradients and optimizer state "
                    f"({host / 2**30:.2f} GiB per rank at the first update) are in host "
                    "memory and the optimizer steps on the CPU")) if n)
        del work, stepper, model, tracker
        gc.collect()
    return ShardedRun(label, models.which(task, campaign), world, offload_optimizer, phases,
                      limits)


CHECKPOINT_NOTE = ("modelled: a torch.distributed.checkpoint sharded save, each rank writing its "
                   "own shards; the state dicts are read (get_state_dict, no copies) and the "
                   "writer stages each local shard to host memory, so the GPU holds the steady "
                   "state between updates plus, at most, one extra copy of the largest local "
                   "shard (a contiguous or dtype copy); host-side staging is not counted")


def _update_later(work: Workload, tracker) -> None:
    """A later update, as its costliest micro-batch: with accumulation, every micro-batch but
    the first finds the update's sharded gradients already there, so they are made first (as
    the first micro-batch leaves them) and one micro-batch runs, then the step. Without
    accumulation the one micro-batch runs from no gradients, as in the loop."""
    from torch.distributed._tools.fsdp2_mem_tracker import _FSDPRefType

    if len(work.group) > 1:
        for p in work.stepper.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
                local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                tracker._update_and_maybe_create_winfos(local, _FSDPRefType.SHARDED_GRAD)
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
    fixed, shard = tracker._split()
    tracker.add_point(fixed, shard + _largest_shard(model, optimizer))
    del model_state, optim_state


def predict_sharded(task: Task, train: list[Item], val: list[Item], plan: Plan, world: int, *,
                    offload_optimizer: bool = False, campaign: bool = True) -> pd.DataFrame:
    """Predicted peak bytes on one GPU of an FSDP2 group of `world` GPUs (2..64), per phase -
    the training phases of `workbook.workload` (forward + loss, backward, first update, later
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
    return pd.concat([run.at(w) for w in worlds], ignore_index=True)


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


