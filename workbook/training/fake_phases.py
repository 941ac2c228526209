"""The training phases run on fake tensors under PyTorch's MemTracker: each phase's peak and its
breakdown by category, for the task's model or (carried from shallow runs) its campaign model."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker

from ..base.errors import WorkbookError, reason
from ..contract.data import Batch
from ..contract.task import Task
from . import campaign as models
from . import traces
from .devices import resolve_device
from .loop import TrainConfig, build_stepper, seed_everything
from .memory import cublas_workspace_bytes
from .workload import TRAINING_PHASES, Workload, targets_of

CATEGORIES = ("Parameter", "Buffer", "Gradient", "Optstate", "Activation", "Temp", "Other")


class PhaseTracker(MemTracker):
    """MemTracker whose peak can be restarted at each phase (the stock peak only grows)."""

    def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
        traces.frozen_without_hooks(self, module)
        return super()._track_module_params_and_buffers(module, install_grad_hooks)

    layers: str | None = None  # fqn of the model's layer list: record every operator (trace)

    def begin(self) -> None:
        """A phase starts: its peak, breakdown and trace from what lives now."""
        self.phase_peak = self._total()
        self.phase_categories = self._categories()  # at the phase's peak
        self.trace: list[tuple[int | None, tuple[int, ...]]] = \
            [(None, self.phase_categories)] if self.layers is not None else []

    def _categories(self) -> tuple[int, ...]:
        return tuple(sum(int(snap.get(k, 0)) for snap in self._curr_mem_snap.values())
                     for k in CATEGORIES)

    def _total(self) -> int:
        return sum(s.get("Total", 0) for s in self._curr_mem_snap.values())

    def _update_peak_stats(self, peak_state) -> None:
        # only the whole-process peak per phase is read: the stock per-module peaks cost a scan
        # of every module's statistics per operator (minutes for a 7 B model's step)
        total = self._total()
        if self.layers is not None:
            layer = traces.layer_of(self._mod_tracker.parents, self.layers,
                                    self._mod_tracker.is_bw)
            self.trace.append((layer, self._categories()))
        if total > self.phase_peak:
            self.phase_peak = total
            self.phase_categories = self._categories()

    def _pre_fw_hook(self, module, inputs) -> None:
        # a second forward of the root module is the next micro-batch or step: start its
        # module statistics afresh (the stock tracker refuses iterations)
        if module in self.memory_tracking and not self._mod_tracker.is_bw:
            name = self._mod_tracker.get_known_fqn(module)
            if set(self._mod_tracker.parents) - {name} == {"Global"}:
                self.reset_mod_stats()
        super()._pre_fw_hook(module, inputs)

    def breakdown(self) -> dict[str, int]:
        return dict(zip(CATEGORIES, self.phase_categories, strict=True))


def fake_model(task: Task, cfg: TrainConfig, fake: FakeTensorMode,
               campaign: bool = False) -> torch.nn.Module:
    """The task's model with every parameter and buffer a fake tensor of `fake`, on the
    configured device. It is built on the meta device and its tensors are re-made in `fake`:
    building inside the fake mode fails for modules that deep-copy their layers
    (`nn.TransformerEncoder` clones one layer N times, and a deep-copied fake tensor lands in
    another fake mode). Shared tensors (tied weights) stay shared. `campaign`: the campaign
    model, when the task declares one."""
    seed_everything(cfg.seed)
    device = resolve_device(cfg.device)
    build = models.factory(task, campaign)
    try:
        model = models.meta_copy(build)
    except Exception as meta:  # a model that reads values while it is built: in the fake mode
        try:
            with torch.device(device):
                model = build()
        except WorkbookError as exc:
            named = models.unconvertible(exc, meta, getattr(build, "piece", "model factory"))
            if named is None:
                raise
            raise named from exc
    remade: dict[int, torch.Tensor] = {}

    def home(t: torch.Tensor) -> torch.Tensor:
        if getattr(t, "fake_mode", None) is fake and t.device == device:
            return t
        if id(t) not in remade:
            fresh = torch.empty(t.shape, dtype=t.dtype, device=device)
            remade[id(t)] = torch.nn.Parameter(fresh, t.requires_grad) \
                if isinstance(t, torch.nn.Parameter) else fresh
        return remade[id(t)]

    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is not None:
                    table[name] = home(t)
    return model


def fake_batch(fake: FakeTensorMode, batch: Batch, device: torch.device) -> Batch:
    """`batch` as fake tensors of `fake` on `device`: made fake where it is, then moved inside
    the mode (a real copy to the GPU would allocate, and the mode refuses one)."""
    with fake:
        return Batch(batch.ids, {k: fake.from_tensor(v).to(device)
                                 for k, v in batch.tensors.items()})


def skips_full_mask(model: torch.nn.Module) -> bool:
    """Whether `model` leaves out an attention mask of all ones: a Hugging Face model with a
    fused attention (SDPA, flash) reads the mask's values and takes the causal path without it
    (+14% measured for the masked path on a small Llama at length 256, micro-batch 1) - a
    choice fake tensors, which carry no values, cannot make."""
    implementation = getattr(getattr(model, "config", None), "_attn_implementation", None)
    return type(model).__module__.startswith("transformers.") and implementation not in (
        None, "eager")


def without_full_mask(batch: Batch) -> Batch:
    """`batch` without its attention mask when every position is attended (read from the
    real values), else as it is."""
    mask = batch.tensors.get("attention_mask")
    if mask is None or not bool(mask.all()):
        return batch
    return Batch(batch.ids, {k: v for k, v in batch.tensors.items() if k != "attention_mask"})


def fake_phases(task: Task, cfg: TrainConfig, batch: Batch, group: list[Batch],
                eval_batch: Batch, label: str, campaign: bool = False,
                layers: str | None = None) -> list[dict]:
    """Every training phase run on fake tensors under the tracker: its peak and breakdown
    (and with `layers`, the fqn of the model's layer list, each operator's memory: `trace`).
    A model that skips an all-ones attention mask (`skips_full_mask`) gets its fake batches
    without one, so they take the path the real batches take."""
    device, rows = resolve_device(cfg.device), []
    targets, group_targets = targets_of(task, batch), sum(targets_of(task, b) for b in group)
    unmasked = {id(b): without_full_mask(b) for b in (batch, *group, eval_batch)}
    with FakeTensorMode(allow_non_fake_inputs=False) as fake:
        stepper = build_stepper(task, cfg, fake_model(task, cfg, fake, campaign))
        skips = skips_full_mask(stepper.model)

        def to_fake(b: Batch) -> Batch:
            return fake_batch(fake, unmasked[id(b)] if skips else b, device)
        work = Workload(stepper, to_fake(batch), [to_fake(b) for b in group],
                        to_fake(eval_batch), targets, group_targets)
        tracker = PhaseTracker()
        tracker.layers = layers
        tracker.track_external(stepper.model, stepper.optimizer, *work.tensors())
        with tracker:
            for phase in TRAINING_PHASES:
                tracker.begin()
                try:
                    work.run(phase)
                except Exception as exc:
                    raise WorkbookError(
                        f"predicting {phase} for {label} failed: an operation of this "
                        f"model does not run on fake tensors ({reason(exc, 300)})",
                        "the measured gates still stand; size this configuration by measuring "
                        "it (notebook 03 with the plan's settings on a machine that fits it)"
                    ) from exc
                rows.append({"phase": phase, "predicted_peak_bytes": tracker.phase_peak,
                             **{f"{k.lower()}_bytes": v for k, v in
                                tracker.breakdown().items()},
                             **({"trace": tracker.trace} if layers else {})})
    return with_workspaces(rows, device)


def with_workspaces(rows: list[dict], device: torch.device) -> list[dict]:
    """On a present GPU, each phase's peak plus the cuBLAS workspaces its matmuls hold in the
    caching allocator (measured: `memory.cublas_workspace_bytes`); unchanged elsewhere."""
    held = cublas_workspace_bytes(device)
    return [{**r, "predicted_peak_bytes": r["predicted_peak_bytes"] + held,
             "cublas_workspace_bytes": held} for r in rows] if held else rows


def campaign_phases(task: Task, cfg: TrainConfig, batch: Batch, group: list[Batch],
                    eval_batch: Batch, label: str) -> tuple[list[dict], str]:
    """`fake_phases` of the campaign model, and how it was sized. A deep one (a
    `campaign.Deep` factory) runs at 3 and 4 layers with every operator's memory recorded, and
    each operator's memory is carried to the full depth (`traces.extrapolate`); the full depth
    is run when the two traces do not line up layer for layer."""
    deep = models.depth_of(task)
    shallow = {n: replace(task, campaign_model=deep.with_layers(n))
               for n in traces.TRACE_DEPTHS} if deep else {}
    lists = {n: traces.layer_list(models.held_on_meta(t.campaign_model), n)
             for n, t in shallow.items()}
    if deep and all(lists.values()):
        runs = {n: fake_phases(t, cfg, batch, group, eval_batch, label, campaign=True,
                               layers=lists[n]) for n, t in shallow.items()}
        rows = []
        for i, phase in enumerate(TRAINING_PHASES):
            categories = traces.extrapolate(*(runs[n][i]["trace"] for n in traces.TRACE_DEPTHS),
                                            deep.layers)
            if categories is None:
                break
            rows.append({"phase": phase, "predicted_peak_bytes": sum(categories),
                         **{f"{k.lower()}_bytes": v
                            for k, v in zip(CATEGORIES, categories, strict=True)}})
        else:
            return with_workspaces(rows, resolve_device(cfg.device)), (
                f"each operator's memory carried from fake runs at "
                f"{' and '.join(map(str, traces.TRACE_DEPTHS))} layers to {deep.layers}")
    how = "run at its full depth" + (
        " (the shallow runs did not line up layer for layer)" if deep else "")
    return fake_phases(task, cfg, batch, group, eval_batch, label, campaign=True), how
