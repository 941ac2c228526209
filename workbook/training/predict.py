"""Device-free memory prediction: run the training phases on fake tensors (shapes and dtypes,
no storage) under PyTorch's MemTracker, which attributes every byte to parameters, buffers,
gradients, optimizer state, activations or temporaries. Sizes micro-batch 16 at length 4096 on
a laptop. The fake runs are `fake_phases`'s; here the plan, the phases a prediction cannot size
(and why), the calibration against a small real run, and the fit on a device."""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, replace

import pandas as pd
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..base.errors import WorkbookError, reason
from ..contract.data import Batch, Item
from ..contract.outputs import eval_mode
from ..contract.task import Task
from . import campaign as models
from .devices import resolve_device
from .fake_phases import campaign_phases, fake_phases
from .loop import TrainConfig
from .memory import cuda_overheads
from .workload import TRAINING_PHASES, Plan, measured_peaks, shaped_batch, sized_batches


def max_positions(task: Task, campaign: bool = False) -> tuple[int, str] | None:
    """The longest sequence the task's model accepts and where that limit comes from: a Hugging
    Face config (`max_position_embeddings`, `n_positions`; nanoGPT's `block_size`) or a
    position-embedding table (an `nn.Embedding` whose name says "pos", or GPT-2's `wpe`). None
    when the model states no limit. The model is built on the meta device: nothing is
    allocated. `campaign`: of the campaign model, when the task declares one."""
    model = meta_model(task, campaign)
    if model is None:
        return None
    config = getattr(model, "config", None)
    for attr in ("max_position_embeddings", "n_positions", "max_seq_len", "block_size"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            return value, f"config.{attr}"
    for name, module in model.named_modules():
        last = name.rsplit(".", 1)[-1].lower()
        if isinstance(module, torch.nn.Embedding) and ("pos" in last or last == "wpe"):
            return module.num_embeddings, f"its position embedding `{name}`"
    return None


def meta_model(task: Task, campaign: bool = False) -> torch.nn.Module | None:
    """The task's model (its campaign model with `campaign`, when declared) built on the meta
    device (nothing allocated), or None when it cannot be built without data."""
    try:
        return models.held_on_meta(models.factory(task, campaign))
    except Exception:
        return None


def longest_accepted(task: Task | None, campaign: bool = True) -> int | None:
    """The planned length when none is given: the (campaign) model's limit, or the task's
    `max_length` where it is shorter (a trainer truncates to it), else None (the data's)."""
    limit = max_positions(task, campaign) if task is not None and \
        task.target_kind.plans_at_model_limit else None
    cut = task.max_length if task is not None else None
    if limit and cut:
        return min(limit[0], cut)
    return limit[0] if limit else cut


class PlanRefused(WorkbookError):
    """The plan's shape is one the model's forward refuses (a sequence longer than its position
    table): notebook 03 fails on it rather than leave every phase "not predicted"."""


def _lengthen_fix(task: Task, limit: int | None, longest: int) -> str:
    shorter = (f"plan at most {limit} positions (plan_length={limit}, or 0 for the model's "
               "longest)") if limit else "plan a shorter length"
    return (f"{shorter}, or build the model with a position table of at least {longest} "
            "entries (its block_size or max_position_embeddings; the samples take the option "
            f"context={longest})")


def check_length(task: Task, plan: Plan, campaign: bool = False) -> None:
    """Refuse a planned length beyond what the model accepts, before any batch is built."""
    longest = max(plan.length or 0, plan.eval_length or 0)
    limit = max_positions(task, campaign) if longest else None
    if limit and longest > limit[0]:
        raise PlanRefused(f"planned length {longest} exceeds the {limit[0]} positions the "
                          f"model of {task.name!r} accepts ({limit[1]})",
                          _lengthen_fix(task, limit[0], longest))


def accepts_length(task: Task, batch: Batch) -> None:
    """Fake tensors carry no values, so an index beyond a position table goes unnoticed there:
    check one real example of the planned length first."""
    words = refused_in_own_words(task, batch)
    if words:
        length = task.main_input(batch.tensors).shape[-1]
        limit = max_positions(task)
        raise PlanRefused(f"the model of {task.name!r} does not accept length {length}: {words}",
                          _lengthen_fix(task, limit[0] if limit and limit[0] < length
                                        else None, length))


def refused_in_own_words(task: Task, batch: Batch) -> str:
    """What the model's forward says (its exception, in its own words) on one real example of
    the batch; "" when it runs."""
    one = Batch(batch.ids[:1], {k: v[:1] for k, v in batch.tensors.items()})
    torch.manual_seed(0)
    model = task.build_model().eval()
    try:
        with torch.no_grad():
            task.forward(model, one.tensors)
    except WorkbookError:
        raise
    except Exception as exc:
        return f"{type(exc).__name__}: {reason(exc, 160)}"
    return ""


def predict(task: Task, train: list[Item], val: list[Item], plan: Plan, lr: float = 1e-3,
            device: str = "cpu", seed: int = 0, cpu_exact: bool = False,
            campaign: bool = False) -> pd.DataFrame:
    """Predicted peak bytes per training phase for `plan`, with the breakdown at each peak. A
    phase the prediction cannot size is a row without bytes whose `note` says why (see
    `path_limits` and `calibration_limits`). `cpu_exact` is for a prediction judged against
    this CPU itself (the benchmark): bf16/fp16 is then checked at the plan's own shapes.
    `campaign`: size the task's campaign model (when declared) on fake tensors; the checks
    against real runs are made on the twin the pilot trains, whose layers are the campaign's."""
    campaign = campaign and models.declared(task)
    if campaign:
        models.check_twin(task)
    try:
        check_length(task, plan, campaign)
    except PlanRefused as exc:
        if campaign:
            raise
        # the model's own words at the shortest length refused: a planned 10 M positions would
        # cost its forward seconds (6.4 s) for the same words
        first = max_positions(task)[0] + 1
        words = refused_in_own_words(task, shaped_batch(task, train, 1, first))
        raise PlanRefused(exc.problem + (f"; at {first} positions its forward says {words}"
                                         if words else ""), exc.fix) from None
    batch, group, eval_batch = sized_batches(task, train, val, plan)
    longest = max(plan.length or 0, plan.eval_length or 0)
    twin_limit = max_positions(task) if campaign and longest else None
    if longest and not (twin_limit and twin_limit[0] < longest):
        accepts_length(task, eval_batch if (plan.eval_length or 0) > (plan.length or 0)
                       else batch)
    limits = {**calibration_limits(task, train, val, plan, device, cpu_exact),
              **path_limits(task, batch, group, eval_batch)}
    cfg = TrainConfig(plan.shape, lr=lr, seed=seed, device=device)
    rows, how = (campaign_phases(task, cfg, batch, group, eval_batch, plan.label()) if campaign
                 else (fake_phases(task, cfg, batch, group, eval_batch, plan.label()), ""))
    frame = pd.DataFrame(rows)
    frame.insert(0, "config", plan.label())
    frame.insert(1, "model", models.which(task, campaign))
    frame.attrs["sized"] = how
    unknown = frame.phase.isin(list(limits))
    frame.loc[unknown, frame.columns.str.endswith("_bytes")] = float("nan")
    scales = {p: v for p, v in calibration_scales(task, train, val, plan, device,
                                                  cpu_exact).items() if p not in limits}
    for phase, (factor, _, _) in scales.items():  # the memory fake tensors miss: "other"
        rows_of = frame.phase == phase
        peak = frame.loc[rows_of, "predicted_peak_bytes"]
        extra = (peak * factor).map(math.ceil) - peak
        frame.loc[rows_of, "predicted_peak_bytes"] = peak + extra
        if "other_bytes" in frame:
            frame.loc[rows_of, "other_bytes"] = frame.loc[rows_of, "other_bytes"] + extra
    frame["note"] = frame.phase.map(lambda p: f"not predicted: {limits[p]}" if p in limits
                                    else scales[p][1] if p in scales else "")
    return frame


CALIBRATION_TOLERANCE = 0.02  # the prediction's target on the CPU
SCALED_LIMIT = 0.10  # a phase off by more than 2% and at most this is sized from the ratio
# ... and for a model whose only hidden-workspace modules are convolutions (or recurrent
# layers: nn.LSTM's oneDNN scratch, word_language_model at -11%), sized for a GPU:
# the CPU's convolution kernels (oneDNN's, or im2col without it) allocate scratch memory in
# proportion to the batch (ResNet-18 at 32 px: forward -17%, validation -9%), which a GPU's
# cuDNN replaces by its own workspace - the measured ratio is then a bound, not a guess
CONV_SCALED_LIMIT = 0.60
SCALE_MARGIN = 0.02  # added to a measured ratio a phase is sized from
Scale = tuple[float, str, str]  # (factor, note, what the real run saw)
# a real run at a low-precision plan's own size is made on the CPU only up to this peak
EXACT_CHECK_BYTES = 512 * 2**20
# per task (held while it lives): (device, small plan) -> (limits, scales), measured once
_calibrated: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def calibration_limits(task: Task, train: list[Item], val: list[Item], plan: Plan,
                       device: str = "cpu", cpu_exact: bool = False) -> dict[str, str]:
    """Phases whose prediction is off by more than 2% against a real run of the same model on
    this device: kernels that allocate memory fake tensors do not see (convolution and
    recurrent workspaces, the float32 scratch buffers of the CPU's bf16/fp16 kernels). The run
    is small (the plan's micro-batch up to 4, at the data's length) where that memory grows
    with the batch. The CPU's bf16/fp16 kernels allocate float32 scratch memory that changes
    with the shapes (0% off at one length, -5.6% at another) and with the CPU itself (AMX or
    not), so: with `cpu_exact` (a prediction judged against this CPU) bf16/fp16 is checked at
    the plan's own shapes, up to `EXACT_CHECK_BYTES`, else those phases are not predicted;
    without it (sizing for a GPU, where those CPU kernels never run) the small run on the CPU is
    made in fp32, which shows the model's own hidden workspaces and no kernel of this CPU's.
    Measured once per task and setting; a real run that fails leaves every phase unpredicted.
    A phase off by no more than `SCALED_LIMIT` is here only with `cpu_exact` (the miss is then
    the finding), else in `calibration_scales`."""
    limits, scales = _calibration(task, train, val, plan, device, cpu_exact)
    if not cpu_exact:
        return limits
    return {**{p: f"{seen} - size this configuration by measuring it"
               for p, (_, _, seen) in scales.items()}, **limits}


def calibration_scales(task: Task, train: list[Item], val: list[Item], plan: Plan,
                       device: str = "cpu", cpu_exact: bool = False
                       ) -> dict[str, Scale]:
    """{phase: (factor, note, what the real run saw)} for phases the real run found off by
    more than 2% and at most `SCALED_LIMIT` (`CONV_SCALED_LIMIT` when every hidden-workspace
    module is a convolution: the CPU's convolution scratch, 3-20%): sized as the
    prediction times the measured ratio plus `SCALE_MARGIN` (never below the prediction), the
    note saying so. Empty for a prediction judged against this CPU (`cpu_exact`): there the
    miss is the finding."""
    return {} if cpu_exact else _calibration(task, train, val, plan, device, cpu_exact)[1]


def _calibration(task: Task, train: list[Item], val: list[Item], plan: Plan, device: str,
                 cpu_exact: bool) -> tuple[dict[str, str], dict[str, Scale]]:
    """(limits, scales) of `calibration_limits` / `calibration_scales`, measured once."""
    precision = plan.shape.precision
    on_cpu = resolve_device(device).type == "cpu"
    exact = cpu_exact and precision != "fp32" and on_cpu
    if exact:
        small = replace(plan, shape=replace(plan.shape, accumulation=1))
    else:
        micro = max(1, min(plan.shape.micro_batch, 4))
        small = Plan(replace(plan.shape, micro_batch=micro, accumulation=1,
                             precision="fp32" if on_cpu else precision), None, micro)
    key, held = (str(device), repr(small)), _calibrated.setdefault(task, {})
    if key in held:
        return held[key]
    batches = sized_batches(task, train, val, small)
    cfg = TrainConfig(small.shape, device=device)
    fake = {r["phase"]: r["predicted_peak_bytes"] for r in
            fake_phases(task, cfg, *batches, small.label())}
    if exact and max(fake.values()) > EXACT_CHECK_BYTES:
        held[key] = (dict.fromkeys(TRAINING_PHASES, (
            f"{precision} on the CPU: its kernels allocate float32 scratch memory that "
            "fake tensors do not see, in amounts that change with the shapes, so only a real "
            f"run at this size checks the prediction, and this one "
            f"({max(fake.values()) / 2**20:.0f} MiB) is above the "
            f"{EXACT_CHECK_BYTES / 2**20:.0f} MiB such a check may take here - measure it on "
            "the GPU, or read the fp32 prediction")), {})
        return held[key]
    try:
        real = measured_peaks(task, cfg, *batches)
    except Exception as exc:  # the gates name what is wrong with the step itself
        why = (f"the real run of {small.label()} that checks the prediction failed "
               f"({reason(exc, 200)})")
        held[key] = (dict.fromkeys(TRAINING_PHASES, why), {})
        return held[key]
    model = meta_model(task)
    hidden = [m for m in (model.modules() if model else ()) if isinstance(m, HIDDEN_WORKSPACE)]
    suspects = sorted({type(m).__name__ for m in hidden})
    # convolutions and recurrent layers: oneDNN's scratch on the CPU (an LSTM at -11%), cuDNN's
    # workspace and reserve space on a GPU
    scratch = bool(hidden) and all(isinstance(m, (torch.nn.modules.conv._ConvNd,
                                                  torch.nn.RNNBase)) for m in hidden)
    scaled_limit = CONV_SCALED_LIMIT if scratch and not exact else SCALED_LIMIT
    if exact:
        suspects.append(f"float32 scratch buffers of the CPU's {precision} kernels")
    limits, scales = {}, {}
    for phase in TRAINING_PHASES:
        off = (fake[phase] - real[phase]) / real[phase]
        if abs(off) <= CALIBRATION_TOLERANCE:
            continue
        seen = (f"on a real run of {small.label()} on {device} this phase's prediction was "
                f"{100 * off:+.1f}% off the measured peak: a kernel allocates memory that fake "
                "tensors do not see" + (f" (suspects: {', '.join(suspects)})" if suspects
                                        else ""))
        if abs(off) <= scaled_limit and not exact:
            factor = max(1.0, real[phase] / fake[phase] * (1 + SCALE_MARGIN))
            scales[phase] = (factor, f"sized from the measured ratio: {seen}, so the "
                             f"prediction is taken x {factor:.3f} (the ratio plus a "
                             f"{SCALE_MARGIN:.0%} margin; never below the prediction) - a "
                             "GPU's kernels may need other workspace: check it on the rental",
                             seen)
        else:
            limits[phase] = seen + " - size this configuration by measuring it"
    held[key] = (limits, scales)
    return held[key]


HIDDEN_WORKSPACE = (torch.nn.modules.conv._ConvNd, torch.nn.RNNBase,
                    torch.nn.MultiheadAttention)


FUSED_INFERENCE = ("aten::_transformer_encoder_layer_fwd", "aten::_native_multi_head_attention",
                   "aten::_nested_tensor_from_mask")


class OpNames(TorchDispatchMode):
    """The names of the operators a block runs."""

    def __init__(self):
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.name())
        return func(*args, **(kwargs or {}))


def path_limits(task: Task, batch: Batch, group: list[Batch],
                eval_batch: Batch) -> dict[str, str]:
    """Phases that fake tensors would size on another path than real tensors take, with the
    reason: `nn.TransformerEncoderLayer` / `nn.MultiheadAttention` run a fused inference kernel
    in evaluation on real tensors only (-24% to -46% measured on examples/transformer_lm.py).
    (A Hugging Face model's skipped all-ones mask is not one: `fake_phases` leaves the mask
    out of such batches, `fake_phases.skips_full_mask`.)"""
    limits: dict[str, str] = {}
    model = meta_model(task)
    kernels = fused_kernels(task, model, eval_batch)
    if kernels:
        limits["validation"] = (
            f"in evaluation this model runs PyTorch's fused inference kernel "
            f"({', '.join(kernels)}) on real tensors only; fake tensors take the unfused "
            "path, which allocates differently - the measured validation row stands")
    return limits


_fused: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # task -> kernel names


def fused_kernels(task: Task, model: torch.nn.Module | None, eval_batch: Batch) -> list[str]:
    """The fused inference kernels one real example runs in evaluation (models with
    `nn.TransformerEncoderLayer`/`DecoderLayer`/`MultiheadAttention`; once per task)."""
    fused = (torch.nn.TransformerEncoderLayer, torch.nn.TransformerDecoderLayer,
             torch.nn.MultiheadAttention)
    if model is None or not any(isinstance(m, fused) for m in model.modules()):
        return []
    if task not in _fused:
        one = Batch(eval_batch.ids[:1], {k: v[:1] for k, v in eval_batch.tensors.items()})
        torch.manual_seed(0)
        real = task.build_model()
        with eval_mode(real), OpNames() as ops:
            task.forward(real, one.tensors)
        _fused[task] = sorted(ops.names & set(FUSED_INFERENCE))
    return _fused[task]


def predicted_or_reason(task: Task, train: list[Item], val: list[Item], plan: Plan,
                        **kwargs) -> pd.DataFrame:
    """`predict`, or - when this configuration cannot be predicted - one row per phase with no
    bytes and `note` saying why (the measured gates still stand)."""
    try:
        return predict(task, train, val, plan, **kwargs)
    except WorkbookError as exc:
        frame = pd.DataFrame({"config": plan.label(),
                              "model": models.which(task, kwargs.get("campaign", False)),
                              "phase": TRAINING_PHASES,
                              "predicted_peak_bytes": float("nan"),
                              "note": f"not predicted: {exc.problem}"})
        if isinstance(exc, PlanRefused):  # the model refuses the plan: 03 fails on it
            frame.attrs["refused"] = f"{exc.problem} -> fix: {exc.fix}"
        return frame


def model_size_rule(model: torch.nn.Module) -> int:
    """The "4 x model size" rule of thumb: weights, gradients and two Adam states."""
    return 4 * sum(p.numel() * p.element_size() for p in model.parameters())


def rule_of_thumb(task: Task, predicted: pd.DataFrame, campaign: bool = False) -> pd.DataFrame:
    """Each phase's prediction next to the "4 x model size" rule and how far the rule is off
    (the model built on the meta device: the campaign model with `campaign`)."""
    rule = model_size_rule(models.held_on_meta(models.factory(task, campaign)))
    peak = predicted.predicted_peak_bytes
    return predicted[["phase", "predicted_peak_bytes"]].assign(
        four_x_model_bytes=rule, rule_error_pct=(100 * (rule - peak) / peak).round(1))


@dataclass
class Overheads:
    """What a tensor prediction does not see on CUDA, measured on a GPU or assumed."""

    context_bytes: int  # CUDA context and library workspaces (cuBLAS, cuDNN)
    cache_share: float  # caching allocator: reserved / allocated - 1
    measured: bool

    @classmethod
    def of(cls, device: torch.device, gates: pd.DataFrame, context_gib: float,
           cache_share: float) -> "Overheads":
        """Measured on CUDA (context from the driver, cache from the gates' reserved against
        allocated peaks); the stated assumptions elsewhere."""
        measured = cuda_overheads(device)
        if measured is None or gates.peak_reserved_bytes.isna().all():
            return cls(int(context_gib * 2**30), cache_share, False)
        share = float((gates.peak_reserved_bytes / gates.peak_allocated_bytes).max() - 1)
        return cls(measured["context_and_workspaces_bytes"], max(share, 0.0), True)


def fit_table(predicted: pd.DataFrame, device_memory_gib: float, headroom: float,
              overheads: Overheads) -> pd.DataFrame:
    """Per phase: what the device must hold (prediction + allocator cache + context, plus
    headroom) and whether it fits the stated device memory."""
    out = predicted[["config", "phase", "predicted_peak_bytes"]].copy()
    need = out.predicted_peak_bytes * (1 + overheads.cache_share) + overheads.context_bytes
    out["required_bytes"] = (need * (1 + headroom)).round().astype("Int64")
    out["device_bytes"] = int(device_memory_gib * 2**30)
    fits = (out.required_bytes <= out.device_bytes).astype("boolean")
    out["fits"] = fits if device_memory_gib else None
    out["overheads"] = "measured" if overheads.measured else "assumed"
    return out


def needs_sharding(fit: pd.DataFrame, overheads: Overheads, headroom: float) -> bool:
    """Whether a plan that does not fit one GPU cannot fit it at any micro-batch, yet sharding
    can help: its first update - the weights, gradients and optimizer state a whole-model
    replica holds, no activations - is itself over the GPU (`fit_table` rows), while the
    GPU's fixed overheads alone (context and workspaces, with headroom) are not. Such a model
    is sharded over several GPUs (notebook 08 sizes FSDP2); a smaller micro-batch cannot
    help, and a GPU that its overheads already fill fits nothing."""
    update = fit[fit.phase == "update (first)"]
    if not len(update) or update.fits.isna().any() or update.fits.astype(bool).any():
        return False
    return overheads.context_bytes * (1 + headroom) < int(update.device_bytes.iloc[0])


def compare(predicted: pd.DataFrame, gates: pd.DataFrame) -> pd.DataFrame:
    """Predicted against measured peak per training phase, with the error in percent (none
    where a gate failed or was blocked before measuring)."""
    measured = gates.set_index("phase").peak_allocated_bytes
    out = predicted[["phase", "predicted_peak_bytes"]].copy()
    out["measured_peak_bytes"] = out.phase.map(measured).astype("Int64")
    out["error_pct"] = (100 * (out.predicted_peak_bytes - out.measured_peak_bytes)
                        / out.measured_peak_bytes).astype("float64").round(3)
    if "note" in predicted:
        out["note"] = predicted.note.values
    return out


def summary_figures(check: pd.DataFrame, plan: Plan, planned: pd.DataFrame,
                    fit: pd.DataFrame) -> dict:
    """Notebook 03's figures of the prediction: None where a configuration was not predicted
    (the reason is kept)."""
    def most(column: pd.Series, cast=int):
        column = column.astype("float")
        return None if column.isna().all() else cast(column.abs().max())

    notes = [f"{where} {r.phase}: {r.note}" for where, frame in (("pilot size", check),
                                                                  (plan.label(), planned))
             if "note" in frame for r in frame.itertuples() if r.note]
    return {"prediction_max_abs_error_pct": most(check.error_pct, float), "plan": plan.label(),
            "plan_peak_bytes": most(planned.predicted_peak_bytes),
            "plan_required_bytes": most(fit.required_bytes),
            "plan_update_required_bytes": most(
                fit[fit.phase == "update (first)"].required_bytes),
            "prediction_notes": notes}
