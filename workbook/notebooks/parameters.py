"""Each notebook's parameters as one pydantic model: names (papermill's spelling), types,
defaults (the same literals as the notebook's `parameters` cell: a test holds them equal) and
ranges; every notebook, the pilot's `-p`, the `--smoke` YAML and a script check through it. A
range is a `Range` on the field's type (Field(ge=...) would name only the bound it broke, not
the interval and what it means); every number anywhere, task_options included, is finite and
a 64-bit integer at most. A bad value is refused before any work, with the parameter, the
value, the rule and the fix."""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Union

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    WrapValidator,
    model_validator,
    with_config,
)
from pydantic_core import PydanticCustomError
from typing_extensions import Required, TypedDict, get_args, is_typeddict

from ..base.errors import WorkbookError
from ..contract.shape import MAX_WORLD, MIN_WORLD, Precision, UpdateShape
from ..contract.task import Task, load_task
from ..storage.schemas import SEED_MAX

TYPES = {"int_type": "int", "float_type": "float", "bool_type": "bool", "string_type": "str",
         "list_type": "list", "dict_type": "dict"}
SWITCHES = {"true": True, "false": False, "yes": True, "no": False, "on": True, "off": False}


def _refused(need: str, value: Any, inner: str = "") -> PydanticCustomError:
    return PydanticCustomError("out_of_range", "{need}", {"need": need, "value": value,
                                                          "inner": inner})


def finite(value: Any, inner: str = "") -> Any:
    """`value` when every number in it (lists and dicts walked) is finite and a 64-bit
    integer at most."""
    if isinstance(value, float) and not math.isfinite(value):
        raise _refused("a finite number (not NaN or infinity)", value, inner)
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 2**63:
        raise _refused("a 64-bit integer (below 2**63 in size)", value, inner)
    items = value.items() if isinstance(value, dict) else \
        enumerate(value) if isinstance(value, (list, tuple)) else ()
    for key, item in items:
        finite(item, f"{inner}[{key}]" if isinstance(value, (list, tuple)) else f"{inner}.{key}")
    return value


@dataclass(frozen=True)
class Range:
    """An interval for a number (`lo`/`hi`, open or closed) and what it means, said when a
    value is refused; a string beside a number (a record's `lr: "study"`) is left alone."""

    why: str
    lo: float = -math.inf
    hi: float = math.inf
    lo_open: bool = False
    hi_open: bool = False

    def interval(self) -> str:
        if self.hi == math.inf:
            return f"{'>' if self.lo_open else '>='} {self.lo:g}"
        return (f"in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}"
                f"{')' if self.hi_open else ']'}")

    def __call__(self, value: Any) -> Any:
        finite(value)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return value
        if not ((value > self.lo if self.lo_open else value >= self.lo)
                and (value < self.hi if self.hi_open else value <= self.hi)):
            raise _refused(f"{self.interval()} ({self.why})", value)
        return value


def _nonempty(why: str) -> Callable[[list], list]:
    def check(value: list) -> list:
        if not value:
            raise _refused(f"a non-empty list ({why})", value)
        return value
    return check


def _switch(value: Any) -> Any:
    """A yes/no as a command line writes it (`fsdp=false`, `fsdp=0`) as a bool; anything
    else is left for the type check to refuse."""
    if isinstance(value, str) and value.strip().lower() in SWITCHES:
        return SWITCHES[value.strip().lower()]
    return bool(value) if type(value) is int and value in (0, 1) else value


# --- the types: an int stays an int, a float parameter takes an int as it is ----------------
def integer(why: str = "", lo: float = -math.inf, **bounds: Any) -> Any:
    return Annotated[StrictInt, AfterValidator(Range(why, lo, **bounds))]


def number(why: str = "", lo: float = -math.inf, **bounds: Any) -> Any:
    return Annotated[Union[StrictInt, StrictFloat], AfterValidator(Range(why, lo, **bounds))]


Switch = Annotated[StrictBool, BeforeValidator(_switch)]
Options = Annotated[dict, AfterValidator(finite)]  # a task factory's keyword arguments
Seed = integer("NumPy's seed range", 0, hi=SEED_MAX)
Lr = number("0: the task's own learning rate", 0)
MicroBatch = integer("examples per forward/backward pass", 1)
Accumulation = integer("passes per optimizer update", 1)
EvalBatch = integer("examples per evaluation pass", 1)
Replicas = integer("data-parallel processes", 1)
Updates = integer("optimizer updates", 1)
Limit = integer("use only the first N examples; 0: all", 0)
Length = integer("positions per sequence; 0: the data's longest", 0)
PlanLength = integer("positions per sequence; 0: the longest the model accepts or the data's", 0)
Examples = integer("a count of examples", 1)
Tolerance = number("an allowed deviation; 0: exact", 0)
Headroom = number("the share kept free on top of every peak", 0, hi=1, hi_open=True)
CudaContext = number("GiB of CUDA context and workspaces", 0)
AllocatorCache = number("reserved/allocated - 1 of the allocator", 0, hi=1)
EvalEvery = integer("updates between evaluations", 1)


class NotebookParams(BaseModel):
    """What every notebook takes: the task, where it writes, the device, the seed. Cells read
    `p["name"]` (a notebook's spelling); the package reads attributes."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    task: StrictStr = "workbook.samples.generation:task"
    task_options: Options = {}
    out_dir: StrictStr = ""
    device: StrictStr = "cpu"
    seed: Seed = 0
    # where `lr` came from ("parameter", "task", "fallback"): set when it is filled from the
    # task (commands.params.task_learning_rates), never given
    lr_from: str | None = Field(None, exclude=True)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The parameters, in the order of the notebook's cell (papermill's names)."""
        return tuple(n for n, f in cls.model_fields.items() if not f.exclude)

    def keys(self) -> tuple[str, ...]:
        return self.names()

    def __getitem__(self, name: str) -> Any:
        if name not in self.names():
            raise KeyError(name)
        return getattr(self, name)

    def load_task(self) -> Task:
        """The task these parameters name."""
        return load_task(self.task, **self.task_options)

    def shape(self, prefix: str = "") -> UpdateShape:
        """The update shape of the parameters `<prefix>micro_batch`, ... (the ones this
        notebook has; the others keep UpdateShape's defaults), checked."""
        return UpdateShape(**{name: getattr(self, prefix + name) for name in
                              UpdateShape.__dataclass_fields__ if prefix + name in self.names()}
                           ).validate()


def check(models: Sequence[type[NotebookParams]], given: Mapping[str, Any], where: str,
          owners: Callable[[str], list[str]] = lambda name: []) -> list[NotebookParams]:
    """`given` checked by each of `models` (every name must belong to one of them; each value
    is checked by every model that has it), defaults filled in; every problem is named in one
    error. `where` names the notebook (its stem) or the notebooks; `owners(name)`: the
    notebooks that take `name`."""
    known = {n for m in models for n in m.names()}
    named = [f"no parameter {name!r}" + (f" (it belongs to {', '.join(owners(name))})"
                                          if owners(name) else "")
             + (f" - did you mean {close[0]!r}?"
                if (close := difflib.get_close_matches(name, known, n=1)) else "")
             for name in sorted(set(given) - known)]
    ranges: list[str] = []
    checked = []
    for model in models:
        try:
            checked.append(model.model_validate({k: v for k, v in given.items()
                                                 if k in model.names()}))
        except ValidationError as exc:
            for error in exc.errors():
                loc = list(error["loc"])
                if error["type"] in ("int_type", "float_type") and loc[-1] in ("int", "float"):
                    if loc.pop() == "int":  # a number's two members refused it: said once
                        continue
                path = "".join(f"[{p}]" if isinstance(p, int) else
                               f"[{p!r}]" if i == 1 else f".{p}" if i else p
                               for i, p in enumerate(loc)) + error.get("ctx", {}).get("inner", "")
                if error["type"] == "out_of_range":
                    value = error["ctx"]["value"]
                    ranges.append(f"parameter {path!r} of {where} is {value!r}; it must be "
                                  f"{error['ctx']['need']}")
                elif error["type"] in ("missing", "extra_forbidden"):
                    named.append(f"parameter {path!r} " + (
                        "is missing" if error["type"] == "missing" else "is not a key of "
                        f"its record (keys: {', '.join(_keys(model, loc[0]))})"))
                else:
                    value = error["input"]
                    want = TYPES.get(error["type"]) or error["msg"].replace("Input should be ",
                                                                           "")
                    named.append(f"parameter {path!r} must be {want}, got "
                                 f"{type(value).__name__} {value!r}")
    named, ranges = list(dict.fromkeys(named)), list(dict.fromkeys(ranges))
    if named:
        unknown = set(given) - known
        raise WorkbookError(f"{where if ' ' in where else f'notebook {where}'}: "
                            + "; ".join(named), "select the notebooks that take it (--only), "
                            f"or use only these parameters: {', '.join(sorted(known))}"
                            if unknown else "give each a value of the type named (the "
                            "notebook's parameters cell shows one)")
    if ranges:
        raise WorkbookError("; ".join(ranges), "give " + ("it a value" if len(ranges) == 1 else
                                                           "each a value")
                            + " in its range (the notebook's parameters cell explains each)")
    return checked


def _keys(model: type[NotebookParams], name: str) -> list[str]:
    """The keys of the records (a TypedDict) that parameter `name` of `model` holds."""
    kinds = [model.model_fields[name].annotation]
    while kinds:
        kind = kinds.pop()
        if is_typeddict(kind):
            return list(kind.__annotations__)
        kinds.extend(get_args(kind))
    return []


# --- the nine notebooks ---------------------------------------------------------------------
class InspectionParams(NotebookParams):
    show_examples: integer("examples rendered; 0: none", 0) = 4
    probe_size: integer("examples that probe the loss function", 1) = 8
    scan_limit: Limit = 0
    scan_sample: number() = 0.0
    scan_workers: integer() = -1


class OverfitParams(NotebookParams):
    examples: integer("examples in the subset (at most the training split: the notebook "
                      "checks that)", 1) = 8
    updates: Updates = 150
    lr: Lr = 0.0
    loss_threshold: number("the loss the subset must fall below", 0, lo_open=True) = 0.05
    init_tolerance: Tolerance = 0.5


class GatesParams(NotebookParams):
    micro_batch: MicroBatch = 2
    accumulation: Accumulation = 8
    eval_batch: EvalBatch = 16
    length: Length = 0
    precision: StrictStr = "fp32"
    activation_checkpointing: Switch = False
    lr: Lr = 0.0
    device_memory_gib: number("GiB of the rental GPU; 0: not given", 0) = 80.0
    headroom: Headroom = 0.2
    input_bound_threshold: number("the data-wait share of an update", 0, hi=1,
                                  lo_open=True) = 0.3
    train_limit: Limit = 0
    plan_micro_batch: MicroBatch = 16
    plan_accumulation: Accumulation = 2
    plan_length: PlanLength = 0
    plan_eval_batch: EvalBatch = 32
    plan_precision: StrictStr = "bf16"
    plan_activation_checkpointing: Switch = False
    cuda_context_gib: CudaContext = 1.0
    allocator_cache_share: AllocatorCache = 0.1


class AccountingParams(NotebookParams):
    micro_batch: MicroBatch = 2
    accumulation: Accumulation = 8
    replicas: Replicas = 1
    drop_partial: Switch = False
    hold: StrictStr = "epochs"
    budget: number("how many updates, examples or epochs the budget holds", 0,
                   lo_open=True) = 1.0
    reconcile_updates: integer("a count of updates", 1) = 30
    reconcile_examples: Examples = 45
    check_examples: Examples = 16
    partial_examples: Examples = 13
    tolerance: Tolerance = 1e-4


class VariantsParams(NotebookParams):
    micro_batch: MicroBatch = 4
    accumulation: Accumulation = 4
    eval_batch: EvalBatch = 16
    length: Length = 0
    short_length: integer("max_length of the truncation variant", 1) = 20
    updates: Updates = 20
    lr: Lr = 0.0
    train_limit: Limit = 0
    val_limit: integer("validation examples of the quality proxy", 1) = 64
    plan_micro_batch: MicroBatch = 16
    plan_accumulation: Accumulation = 2
    plan_length: PlanLength = 0
    plan_eval_batch: EvalBatch = 32


class StudyParams(NotebookParams):
    study_name: StrictStr = "lr-comparison"
    lrs: list[number("learning rates; an empty list: a range test places them", 0,
                     lo_open=True)] = []
    extra_trials: integer("trials the study may add past its grid's edge; 0: none", 0) = 2
    range_min_lr: number("a bound of the range test's rates", 0, lo_open=True) = 1e-07
    range_max_lr: number("a bound of the range test's rates", 0, lo_open=True) = 10.0
    range_updates: integer("updates of the range test", 1) = 50
    seeds: Annotated[list[integer("one trial per seed; NumPy's seed range", 0, hi=SEED_MAX)],
                     AfterValidator(_nonempty("one trial per seed; NumPy's seed range"))] = [0]
    updates: Updates = 200
    micro_batch: MicroBatch = 2
    accumulation: Accumulation = 8
    eval_every: EvalEvery = 50
    eval_batch: EvalBatch = 32
    eval_sample: integer("periodic evaluation sample; 0: the whole validation set", 0) = 0
    metric: StrictStr = "loss"
    top_n: integer("best checkpoints kept per trial", 1) = 2
    divergence_multiple: number("a multiple of the first loss; <= 1 stops every trial", 1,
                                lo_open=True) = 3.0
    prediction_examples: integer("validation examples whose predictions are saved; 0: none",
                                 0) = 4
    notes: StrictStr = "none"


class ResumeParams(NotebookParams):
    micro_batch: MicroBatch = 2
    accumulation: Accumulation = 8
    lr: Lr = 0.0
    updates: Updates = 10
    train_limit: Limit = 64
    mid_step: integer("an update number, from 1", 1) = 6
    boundary_step: integer("0: the first pass's last update", 0) = 0
    twice_step: integer("0: halfway from mid_step to updates", 0) = 0
    workers: integer("DataLoader worker processes; 0: none", 0) = 2
    use_pipeline: Switch = True
    tolerance: Tolerance = 0.0
    demonstrate_faults: Switch = True
    controls: integer("control inputs kept in the archive", 1) = 8


@with_config(ConfigDict(extra="forbid"))
class CandidateSpec(TypedDict, total=False):
    """One of 08's `candidates` (`rental.candidates.Candidate`): a name, the update shape's
    fields (precision bf16 unless given), the sizes, the result expected, and how it spreads
    over GPUs; whether the strategy and its settings agree is the candidate's rule
    (`rental.candidates.check_strategy`)."""

    name: Required[StrictStr]
    micro_batch: MicroBatch
    accumulation: Accumulation
    precision: Precision
    activation_checkpointing: StrictBool
    replicas: Replicas
    length: Length
    eval_batch: EvalBatch
    expected: StrictStr
    strategy: Literal["", "single", "ddp", "fsdp"]  # "": single or ddp by the replicas
    world: Union[integer("the GPUs FSDP full sharding is sized over; one GPU: strategy "
                         "single", MIN_WORLD, hi=MAX_WORLD), None]  # None: the smallest fitting
    gpus_per_node: integer("GPUs per node", 1)
    offload_optimizer: StrictBool


def _rate(value: Any) -> Any:
    if isinstance(value, str) and value in ("control", "study"):
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise _refused("a number of 0 or more (0: the task's own), 'control' (06's control) "
                       "or 'study' (the rate 06's study supports)", value)
    return finite(value)


@with_config(ConfigDict(extra="forbid"))
class VariantSpec(TypedDict, total=False):
    """One of 08's `variants`: a candidate of the list (`RentalParams`' rule) run `repeats`
    times at `lr`, packed into the plans by `priority`."""

    name: Required[StrictStr]
    priority: Required[number("the order the plans are packed in")]
    candidate: Required[StrictStr]
    repeats: integer("runs of the variant", 1)
    lr: Annotated[Any, AfterValidator(_rate)]


def _kept(value: Any, handler: Callable[[Any], Any]) -> Any:
    handler(value)  # checked; the record stays as given, its keys in their order
    return value


def _records(kind: type, nonempty: str = "") -> Any:
    records = list[Annotated[kind, WrapValidator(_kept), AfterValidator(finite)]]
    return Annotated[records, AfterValidator(_nonempty(nonempty))] if nonempty else records


class RentalParams(NotebookParams):
    gpus: dict[StrictStr, number("GiB of memory of each GPU", 0, lo_open=True)] = {
        "L4": 24, "A100-40GB": 40, "L40S": 48, "A100-80GB": 80, "H100": 80, "H200": 141}
    gpu_tflops: dict[StrictStr, number("dense peak TFLOP/s of each GPU", 0, lo_open=True)] = {
        "L4": 121, "A100-40GB": 312, "L40S": 362, "A100-80GB": 312, "H100": 989, "H200": 989}
    price_catalog: StrictStr = ""
    gpu_price_per_hour: dict[StrictStr, number("price per GPU-hour", 0)] = {}
    currency: StrictStr = "USD"
    spot_interruptions_per_day: number() = 1.0
    spot_restart_minutes: number() = 10.0
    speeds: StrictStr = "references"
    utilisation: number("the share of peak FLOP/s the training reaches", 0, hi=1,
                        lo_open=True) = 0.35
    rental_gpu: StrictStr = "A100-80GB"
    candidates: _records(CandidateSpec, "the configurations to rent for") = [
        {"name": "control", "micro_batch": 16, "accumulation": 2, "precision": "bf16",
         "expected": "the rate the study supports, at campaign scale"},
        {"name": "checkpointed", "micro_batch": 32, "accumulation": 1, "precision": "bf16",
         "activation_checkpointing": True,
         "expected": "same effective batch, fewer passes per update"},
        {"name": "2 replicas", "micro_batch": 16, "accumulation": 1, "precision": "bf16",
         "replicas": 2, "expected": "same effective batch on two GPUs"}]
    updates: Updates = 20000
    eval_every: EvalEvery = 500
    export_minutes: number("minutes to save and export", 0) = 5.0
    headroom: Headroom = 0.2
    cuda_context_gib: CudaContext = 1.0
    allocator_cache_share: AllocatorCache = 0.1
    variants: _records(VariantSpec) = [
        {"name": "control", "priority": 1, "candidate": "control", "repeats": 3,
         "lr": "control"},
        {"name": "best study lr", "priority": 2, "candidate": "control", "repeats": 3,
         "lr": "study"},
        {"name": "checkpointed", "priority": 3, "candidate": "checkpointed", "repeats": 1,
         "lr": "study"}]
    reserve_share: number("a share of the whole", 0, hi=1, hi_open=True) = 0.2
    entry_point: str = "train.py"  # the training script the launch files run under torchrun
    train_limit: Limit = 200

    @model_validator(mode="after")  # a rule across fields: its own error, raised as it is
    def _variants_name_candidates(self) -> RentalParams:
        names = [c["name"] for c in self.candidates]
        wrong = [f"variant {v['name']!r} names candidate {v['candidate']!r}, which is not in "
                 "the candidates" for v in self.variants if v["candidate"] not in names]
        if wrong:
            raise WorkbookError("; ".join(wrong), f"name one of the candidates {names}")
        return self


class ParallelParams(NotebookParams):
    task_options: Options = {"tie_embeddings": True}
    replicas: Replicas = 2
    micro_batch: MicroBatch = 2
    accumulation: Accumulation = 2
    lr: Lr = 0.0
    updates: Updates = 10
    train_limit: Limit = 32
    validation_limit: Limit = 63
    eval_batch: EvalBatch = 6
    check_examples: Examples = 16
    checkpoint_at: integer("the update after which rank 0 checkpoints", 1) = 5
    tolerance: Tolerance = 1e-4
    resume_tolerance: Tolerance = 0.0
    demonstrate_faults: Switch = True
    launch_timeout: integer("seconds for one launch", 0, lo_open=True) = 600
    fsdp: Switch = True

    @model_validator(mode="after")  # a rule across fields: its own error, raised as it is
    def _checkpoint_before_the_last(self) -> ParallelParams:
        if not self.checkpoint_at < self.updates:
            raise WorkbookError(f"checkpoint_at {self.checkpoint_at} is not an update before "
                                f"the last (updates={self.updates}): the resume check needs a "
                                "checkpoint to continue from",
                                f"give checkpoint_at between 1 and {self.updates - 1}")
        return self
