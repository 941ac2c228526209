"""One schema per file the workbook writes and reads back (pydantic v2), checked before any
value in it is used: the manifest, a checkpoint's meta and state, the recipe, an archive's
configuration, control inputs and outputs, a study design and its trials' parameters, a fresh
process's result, a resumed run's records and a notebook's summary. Types are strict (a
counter "five" or a learning rate "1e-3" is refused, not converted), numbers finite and in
their range (positive where they must be, steps and positions never negative), and JSON is
parsed bounded: a file above MAX_JSON_BYTES, nested deeper than MAX_JSON_DEPTH or holding an
integer of more than MAX_INT_DIGITS digits is refused before (or while) it is parsed. A file
that fails names the file, the field and what was expected.

The configurations stored (`UpdateShape`, `TrainConfig`, the launch specs, `StudyDesign`) are
dataclasses of the layers above, declared once: their fields are annotated with this module's
constrained types (`Count`, `Positive`, `Seed` ...) and `derived(cls)` makes each one's schema
from its own fields, names, types and defaults - no schema here repeats them. The same schema
checks an instance as it stands (`checked`, then the rules across its fields, kept beside the
type) and a record read back (`built`): no configuration re-checks its types by hand."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
import typing
from pathlib import Path
from typing import Annotated, Any, Callable, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    StrictBool,
    StrictStr,
    ValidationError,
    create_model,
    field_validator,
)

from ..base.errors import WorkbookError
from .files import with_article

MAX_JSON_BYTES = 256 * 2**20  # a metrics file of a long run is a few MiB
MAX_JSON_DEPTH = 64  # the workbook nests its files 6 deep
MAX_INT_DIGITS = 40  # a seed or a byte count has at most 20
SEED_MAX = 2**32 - 1  # NumPy's seed range (seed_everything seeds it); cli and params check by it
MAX_THREADS = 4096
MAX_IDS = 1_000_000

Count = Annotated[int, Strict(), Field(ge=1)]  # a count of something: 1 or more
Index = Annotated[int, Strict(), Field(ge=0)]  # a step, a position, a size: 0 or more
Seed = Annotated[int, Strict(), Field(ge=0, le=SEED_MAX)]
Positive = Annotated[float, Strict(), Field(gt=0, allow_inf_nan=False)]
NonNegative = Annotated[float, Strict(), Field(ge=0, allow_inf_nan=False)]
Number = Annotated[float, Strict()]  # any float, NaN included (a diverged loss is one)
Digest = Annotated[str, Strict(), Field(pattern=r"^[0-9a-f]{64}$")]
Name = Annotated[str, Strict(), Field(min_length=1, max_length=4096)]
Options = dict[StrictStr, Any]
Multiple = Annotated[float, Strict(), Field(gt=1, allow_inf_nan=False)]  # a factor above 1

M = TypeVar("M", bound=BaseModel)
D = TypeVar("D")


class Closed(BaseModel):
    """A record whose fields are all known: anything else in it is refused by name."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)


class Open(BaseModel):
    """A record that may carry more than the fields checked here (a caller's own meta data)."""

    model_config = ConfigDict(extra="allow", arbitrary_types_allowed=True)


# --- bounded parsing ---------------------------------------------------------------------
class _TooLong(ValueError):
    pass


def _int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise _TooLong(f"an integer of {len(text.lstrip('-'))} digits (at most "
                       f"{MAX_INT_DIGITS} are read)")
    return int(text)


_STRINGS = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKETS = re.compile(rb"[\[\]{}]")


def json_depth(raw: bytes) -> int:
    """How deep arrays and objects nest in the JSON text `raw` (strings are skipped)."""
    depth = deepest = 0
    for match in _BRACKETS.finditer(_STRINGS.sub(b'""', raw)):
        depth += 1 if match.group() in b"[{" else -1
        deepest = max(deepest, depth)
    return deepest


def parse_json(raw: bytes | str, path: Path | str, what: str,
               fix: str = "use an intact copy") -> Any:
    """The JSON value in `raw`, read from `path`, parsed bounded in size, depth and integer
    length; anything else (not JSON, not UTF-8) is a WorkbookError naming the file."""
    if isinstance(raw, str):
        raw = raw.encode("utf-8", "surrogatepass")
    if len(raw) > MAX_JSON_BYTES:
        raise WorkbookError(f"{what} {path} holds {len(raw):,} bytes, more than the "
                            f"{MAX_JSON_BYTES:,} such a file can have", fix)
    depth = json_depth(raw)
    if depth > MAX_JSON_DEPTH:
        raise WorkbookError(f"{what} {path} nests arrays or objects {depth} deep (the "
                            f"workbook writes at most {MAX_JSON_DEPTH})", fix)
    try:
        return json.loads(raw, parse_int=_int)
    except _TooLong as exc:
        raise WorkbookError(f"{what} {path} holds {exc}", fix) from None
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise WorkbookError(f"{path} is not valid JSON, so the {what} cannot be read "
                            f"({str(exc)[:200]})", fix) from None


# --- checking ----------------------------------------------------------------------------
def _where(loc: tuple) -> str:
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def _is_tensor(value: Any) -> bool:
    import torch

    return isinstance(value, torch.Tensor)


def _got(value: Any) -> str:
    if _is_tensor(value):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def problems(exc: ValidationError, limit: int = 3, prefix: tuple = (),
             whole: str = "this file") -> str:
    """The first few failures of a validation, each as `field: what was expected (got ...)`
    (`whole`: what the fields belong to)."""
    parts = []
    for error in exc.errors()[:limit]:
        expected = re.sub(r"^(Input|List|String|Dictionary) should", "should", error["msg"])
        if error["type"] == "extra_forbidden":
            expected = f"is not a field of {whole}"
        elif error["type"] == "missing":
            expected = "is missing"
        got = "" if error["type"] in ("missing", "extra_forbidden") else \
            f" (got {_got(error.get('input'))})"
        where = _where((*prefix, *error["loc"]))
        parts.append(f"{f'field {where!r}' if where else whole} {expected}{got}")
    more = len(exc.errors()) - limit
    return "; ".join(parts) + (f"; and {more} more" if more > 0 else "")


def check(model: type[M], data: Any, path: Path | str, what: str,
          fix: str = "use an intact copy", field: str = "") -> M:
    """`data` (read from `path`; its `field` when it is part of the file) as a `model` record,
    or a WorkbookError naming the file, the field and what was expected."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise WorkbookError(f"{what} {path} is not {with_article(what)} this workbook wrote: "
                            f"{problems(exc, prefix=(field,) if field else ())}", fix) from None
    except RecursionError:
        raise WorkbookError(f"{what} {path} nests its values too deep", fix) from None


def read(path: Path | str, model: type[M], what: str, fix: str = "use an intact copy") -> M:
    """A JSON file from a folder (never through a link), parsed bounded and checked."""
    from .files import read_plain

    return check(model, parse_json(read_plain(Path(path), what, fix), path, what, fix), path,
                 what, fix)


# --- the stored dataclasses --------------------------------------------------------------
@functools.cache
def derived(cls: type, every_field: bool = False) -> type[BaseModel]:
    """The closed schema of a stored dataclass, made from its own fields: each field's
    annotation (this module's constrained types; a dataclass field: that dataclass's derived
    schema) and its default (a dataclass default as its record). `every_field`: a file that
    must hold every field (written whole, never by an older version), so none defaults."""
    hints = typing.get_type_hints(cls, include_extras=True)
    spec: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        nested = derived(kind) if dataclasses.is_dataclass(kind) else None
        if every_field or (f.default is dataclasses.MISSING
                           and f.default_factory is dataclasses.MISSING):
            spec[f.name] = (nested or kind, ...)
        elif f.default_factory is not dataclasses.MISSING:
            spec[f.name] = (kind, Field(default_factory=f.default_factory))
        elif nested is not None:
            spec[f.name] = (nested, nested.model_validate(dataclasses.asdict(f.default)))
        else:
            spec[f.name] = (kind, f.default)
    return create_model(cls.__name__, __base__=Closed, __doc__=f"{cls.__qualname__}, as stored",
                        **spec)


def checked(value: D, what: str, fix: str,
            conflicts: Callable[[], list[tuple[str, str]]] = list) -> D:
    """A stored dataclass as it stands, checked: every field against its derived schema (each
    type and range problem named, together; `fix`), then - they pass - the rules across its
    fields (`conflicts()`: each problem with its fix, together); a WorkbookError `what: ...`."""
    try:
        derived(type(value)).model_validate(value, from_attributes=True)
    except ValidationError as exc:
        raise WorkbookError(f"{what}: {problems(exc, 8, whole=f'the {what}')}", fix) from None
    found = conflicts()
    if found:
        raise WorkbookError(f"{what}: " + "; ".join(p for p, _ in found),
                            "; ".join(dict.fromkeys(f for _, f in found)))
    return value


def built(cls: type[D], data: Any, what: str, fix: str) -> D:
    """A stored dataclass from its record (a dict, as JSON gives it), checked against its
    derived schema first (a WorkbookError `what: ...` naming every problem, the fields in
    `fix`); values are kept as given."""
    try:
        derived(cls).model_validate(data)
    except ValidationError as exc:
        raise WorkbookError(f"{what}: {problems(exc, 8, whole=f'the {what}')}",
                            f"{fix} (its fields: {', '.join(derived(cls).model_fields)})"
                            ) from None
    return build(cls, data)


def build(cls: type[D], data: dict[str, Any]) -> D:
    """A stored dataclass from a record already checked, its dataclass fields built too."""
    hints = typing.get_type_hints(cls, include_extras=True)
    return cls(**{k: build(hints[k], v) if dataclasses.is_dataclass(hints[k]) else v
                  for k, v in data.items()})


# --- artifact folders --------------------------------------------------------------------
class FileEntry(Closed):
    bytes: Index
    sha256: Digest


class Manifest(Closed):
    format: Literal["workbook-manifest-1"]
    files: dict[Name, FileEntry] = Field(min_length=1)


# --- configurations ----------------------------------------------------------------------
class RecordedTask(Open):
    """What a folder records of the task that wrote it (compared, never imported)."""

    task: Name
    task_options: Options = {}


class TensorEntry(Closed):
    """One tensor of a model as a checkpoint records it: shape, dtype, digest of its values."""

    shape: list[Index]
    dtype: StrictStr
    digest: StrictStr


class CheckpointMeta(Open):
    """meta.json of a checkpoint (a caller's own fields beside these are kept as they are):
    `tensors`, the model's tensors as saved (a task's own save_state); `base`, the model as
    the writing process built it (absent from older checkpoints: not known)."""

    torch: StrictStr
    threads: Annotated[int, Strict(), Field(ge=1, le=MAX_THREADS)]
    digests: dict[StrictStr, StrictStr] = {}
    own_state: StrictBool = False
    tensors: dict[StrictStr, TensorEntry] | None = None
    base: dict[StrictStr, TensorEntry] | None = None
    recipe: RecordedTask | None = None
    task_name: Name | None = None


class DataCounters(Closed):
    """A training pipeline's position: the pass, the examples read in it, its own state."""

    epoch: Index
    examples: Index
    state: Any = None


class Counters(Open):
    """The loop's counters: the updates done and the data position (pass, next update)."""

    step: Index | None = None
    epoch: Index = 0
    group: Index = 0
    micro_batch_in_group: Index = 0
    sampler_state: Any = None
    data: DataCounters | None = None  # a task's train_pipeline: where it stands


class ResumeCounters(Counters):
    """The counters a checkpoint of notebook 07's run must hold to be resumed."""

    step: Index
    epoch: Index
    group: Index


class ReplicaCounters(ResumeCounters):
    """The counters of a checkpoint of notebook 09's launch: the processes that wrote it and
    each rank's random states (a 07 checkpoint has neither: it cannot resume a launch)."""

    world: Count
    rank_rng: list[Any] = Field(min_length=1)


def _tensor(value: Any, dtype: str, shape: tuple[int, ...] | None, what: str) -> Any:
    import torch

    dtype = getattr(torch, dtype)
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{what} must be a tensor, got {_got(value)}")
    if value.dtype != dtype or (shape is not None and tuple(value.shape) != shape) or \
            (shape is None and value.dim() != 1):
        want = f"shape {shape}" if shape is not None else "one dimension"
        raise ValueError(f"{what} must be a {dtype} tensor of {want}, got {_got(value)}")
    return value


class RandomStates(Closed):
    """checkpoint.rng_state: Python, NumPy, torch (and CUDA) random states."""

    python: tuple[Annotated[int, Strict()], Any, Number | None]
    numpy: tuple[Literal["MT19937"], Any, Annotated[int, Strict(), Field(ge=0, le=624)],
                 Annotated[int, Strict(), Field(ge=0, le=1)], Number]
    torch: Any
    cuda: list[Any] | None = None

    @field_validator("python")
    @classmethod
    def _python(cls, value: tuple) -> tuple:
        state = _tensor(value[1], "int64", (625,), "Python's state")
        if bool(((state[:624] < 0) | (state[:624] > 2**32 - 1)).any()) or \
                not 0 <= int(state[624]) <= 624:
            raise ValueError("Python's state must hold 624 words in 0..2**32-1 and a "
                             "position in 0..624")
        return value

    @field_validator("numpy")
    @classmethod
    def _numpy(cls, value: tuple) -> tuple:
        keys = _tensor(value[1], "int64", (624,), "NumPy's keys")
        if bool(((keys < 0) | (keys > 2**32 - 1)).any()):
            raise ValueError("NumPy's keys must be in 0..2**32-1")
        return value

    @field_validator("torch")
    @classmethod
    def _torch(cls, value: Any) -> Any:
        return _tensor(value, "uint8", None, "torch's state")

    @field_validator("cuda")
    @classmethod
    def _cuda(cls, value: list | None) -> list | None:
        for i, state in enumerate(value or []):
            _tensor(state, "uint8", None, f"CUDA device {i}'s state")
        return value


class CheckpointState(Closed):
    """state.pt of a checkpoint (loaded with weights_only=True)."""

    optimizer: dict[Any, Any] | None
    scheduler: dict[Any, Any] | None
    scaler: dict[Any, Any] | None
    counters: Counters
    rng: RandomStates
    carried: dict[StrictStr, list[Any]] | None = None  # Task.state per stream (state.py)
    averaged_model: dict[Any, Any] | None = None  # Task.averaged_model's state_dict


# --- archives ----------------------------------------------------------------------------
class ArchiveConfig(Closed):
    task: Name
    task_options: Options = {}
    train: dict[StrictStr, Any] = {}
    task_name: Name


class Revision(Closed):
    commit: StrictStr | None
    dirty: StrictBool | None
    note: StrictStr = ""


class ControlInputs(BaseModel):
    ids: list[Annotated[str, Strict(), Field(max_length=4096)]] = Field(min_length=1,
                                                                       max_length=MAX_IDS)


# --- studies -----------------------------------------------------------------------------
class TrialParams(Closed):
    """A trial's parameters as the ledger stores them."""

    lr: Positive
    seed: Seed


# --- what commands and notebooks hand back -----------------------------------------------
class HandedBackError(Closed):
    problem: StrictStr
    fix: StrictStr


class Outcome(Closed):
    """What `trial`, `resume` and `reload` write to --result."""

    command: StrictStr = ""
    exit_code: Annotated[int, Strict(), Field(ge=0, le=255)]
    result: dict[StrictStr, Any] | None
    error: HandedBackError | None


class ResumedRecord(Closed):
    """One update of a resumed run, as `workbook resume` hands it back."""

    step: Count
    epoch: Index
    loss: Number
    lr: NonNegative
    ids: list[StrictStr]
    resumed_by: StrictStr | None = None  # the first record: how the data position came back
    skipped: Index | None = None
    skip_s: NonNegative | None = None


class ResumedRecords(BaseModel):
    records: list[ResumedRecord]


class Summary(Open):
    """A notebook's summary.json, as the pilot and the report read it."""

    verdict: Literal["pass", "fail", "error"]
    figures: dict[StrictStr, Any] = {}


# --- tensors against what they load into -------------------------------------------------
def tensor_mismatch(name: str, stored: tuple[Any, tuple], into: Any,
                    theirs: str = "the model's") -> str | None:
    """Why a stored tensor (dtype, shape) cannot be loaded into the tensor `into` (`theirs`
    names it) without a cast or a failure, or None."""
    dtype, shape = stored
    dtype, want = (str(d).replace("torch.", "") for d in (dtype, into.dtype))
    if tuple(shape) != tuple(into.shape):
        return f"{name} has shape {tuple(shape)}, {theirs} has {tuple(into.shape)}"
    if dtype != want:
        return f"{name} is stored as {dtype}, {theirs} is {want}"
    return None


_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16",
                       "BF16": "bfloat16", "I64": "int64", "I32": "int32", "I16": "int16",
                       "I8": "int8", "U8": "uint8", "BOOL": "bool", "F8_E4M3": "float8_e4m3fn",
                       "F8_E5M2": "float8_e5m2", "U16": "uint16", "U32": "uint32",
                       "U64": "uint64"}


def safetensors_header(path: Path) -> dict[str, tuple[str, tuple]]:
    """Each tensor's (dtype, shape) in a safetensors file, read from its header (bounded)."""
    from .files import open_plain

    with open_plain(path) as handle:
        head = handle.read(8)
        if len(head) < 8:
            raise ValueError("shorter than a safetensors header")
        size = int.from_bytes(head, "little")
        if size > 100 * 2**20:
            raise ValueError(f"a header of {size:,} bytes")
        header = parse_json(handle.read(size), path, "safetensors header")
    if not isinstance(header, dict):
        raise ValueError("its header is not a JSON object")
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict) or not isinstance(entry.get("shape"), list):
            raise ValueError(f"its header entry {name!r} is not a tensor")
        dtype = entry.get("dtype")
        out[name] = (_SAFETENSORS_DTYPES.get(dtype, str(dtype)), tuple(entry["shape"]))
    return out


ELEMENTWISE = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg",
               "acc_delta", "sum", "grad_avg", "ax", "eta", "prev", "mu_product", "state1",
               "state2")


def optimizer_mismatch(state: dict, optimizer: Any) -> str | None:
    """Why an optimizer state dict cannot be loaded into `optimizer` without changing what it
    holds: the number of groups and parameters, and every per-parameter tensor of the
    elementwise kinds (Adam's moments, momentum...) against its parameter's shape and dtype.
    None when it fits."""
    groups, stored = optimizer.param_groups, state.get("param_groups")
    per_param = state.get("state")
    if not isinstance(stored, list) or not isinstance(per_param, dict):
        return "it holds no param_groups list and state table"
    if len(stored) != len(groups):
        return f"it has {len(stored)} parameter group(s), the optimizer {len(groups)}"
    params: dict[Any, Any] = {}
    for i, (mine, theirs) in enumerate(zip(groups, stored, strict=True)):
        ids = theirs.get("params") if isinstance(theirs, dict) else None
        if not isinstance(ids, list) or len(ids) != len(mine["params"]):
            return f"its parameter group {i} has {len(ids) if isinstance(ids, list) else 'no'}" \
                   f" parameters, the optimizer's {len(mine['params'])}"
        for key in ("lr", "weight_decay", "momentum", "eps"):
            value = theirs.get(key)
            if isinstance(value, float) and not math.isfinite(value):
                return f"its parameter group {i} has {key} {value}"
        params.update(zip(ids, mine["params"], strict=True))
    for pid, entry in per_param.items():
        if pid not in params:
            return f"it holds state for parameter {pid!r}, which no group lists"
        if not isinstance(entry, dict):
            return f"the state of parameter {pid!r} is not a table"
        param = params[pid]
        for key, value in entry.items():
            if key not in ELEMENTWISE:
                continue
            if not _is_tensor(value):
                return f"state[{pid!r}][{key!r}] is not a tensor ({_got(value)})"
            why = tensor_mismatch(f"state[{pid!r}][{key!r}]", (value.dtype, value.shape), param,
                                  "its parameter's")
            if why:
                return why
    return None
