"""Checkpoints as folders: weights in safetensors, the rest loadable with `weights_only=True`,
and a manifest of every file (see `artifacts`). Written to a temporary folder and renamed, so a
kill during a save never leaves a half-written checkpoint under the final name."""

from __future__ import annotations

import hashlib
import json
import pickle
import random
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_model, save_model

from ..base.errors import WorkbookError, reason
from ..contract.task import own_code
from ..storage import schemas
from ..storage.artifacts import MANIFEST, read_json, write_folder
from ..storage.artifacts import verify as verify_folder
from . import model_record

WEIGHTS = "model.safetensors"
STATE = "state.pt"
META = "meta.json"
__all__ = ["MANIFEST", "WEIGHTS", "STATE", "META", "save_checkpoint", "load_checkpoint",
           "load_state", "load_meta", "load_weights", "verify", "rng_state", "set_rng_state",
           "tied_groups", "StepCount", "own_objects", "tensor_record"]


def rng_state() -> dict[str, Any]:
    """Python, NumPy, torch and CUDA random states in a form `weights_only` loading accepts."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss = random.getstate()
    state = {"python": [version, torch.tensor(internal, dtype=torch.int64), gauss],
             "numpy": [name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached],
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any], where: Any = "the checkpoint") -> None:
    """Restore what `rng_state` captured, checked first (`schemas.RandomStates`: a state of
    another type, length or range is refused naming the field, before any generator is set)."""
    schemas.check(schemas.RandomStates, state, where, "random state",
                  "resume from an intact checkpoint")
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal.tolist()), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class StepCount:
    """The updates done, as the object a task's save_state/restore_state receives under
    "step": state_dict() -> {"step": n}; a restore loads it back with load_state_dict."""

    def __init__(self, value: int | None = None):
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = state["step"]


def own_objects(model: torch.nn.Module, optimizer: Any, scheduler: Any, scaler: Any,
                sampler: Any = None, step: int | None = None,
                averaged: Any = None) -> dict[str, Any]:
    """The objects a task's save_state/restore_state receives: the training state, the loop's
    sampler (when it keeps state), the step count and the averaged model (Task.averaged_model,
    None without one)."""
    keeps_state = callable(getattr(sampler, "state_dict", None))
    return {"model": model, "optimizer": optimizer, "scheduler": scheduler, "scaler": scaler,
            "sampler": sampler if keeps_state else None, "step": StepCount(step),
            "averaged_model": averaged}


def save_checkpoint(path: str | Path, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer | None = None, scheduler: Any = None,
                    scaler: Any = None, counters: dict | None = None,
                    meta: dict | None = None, own: Callable | None = None,
                    sampler: Any = None, carry: Any = None, base: dict | None = None,
                    averaged: Any = None) -> Path:
    """Save the full training state into a new folder `path` (never over an existing one).
    With `own` (a task's `save_state(folder, objects)`), the task writes model, optimizer,
    schedule, scaler, sampler and step its own way; the workbook adds the loop's counters, the
    random states and digests of what was saved (each model tensor's too), which the restore
    checks. A task's carried state between batches (`carry`, Task.state) is always saved by the
    workbook. `base`: the `tensor_record` of the model as this process built it, kept to tell a
    resumed process that builds another base."""
    objects = own_objects(model, optimizer, scheduler, scaler, sampler,
                          (counters or {}).get("step"), averaged)

    def fill(tmp: Path) -> None:
        if own is not None:
            user_code("save_state", own, tmp, objects)
            # the workbook's own files beside the task's (its model.safetensors is the task's
            # here: `save_pretrained` writes one)
            reserved = {STATE, META, MANIFEST}
            clash = reserved & {f.name for f in tmp.iterdir()}
            folders = [f.name for f in tmp.iterdir() if not f.is_file()]
            if clash or folders:
                raise WorkbookError(f"the task's save_state wrote {sorted(clash | set(folders))}"
                                    f" into the checkpoint", f"write plain files, none named "
                                    f"{sorted(reserved)}")
        else:
            save_model(model, str(tmp / WEIGHTS))
        mine = own is None
        torch.save({"optimizer": optimizer.state_dict() if mine and optimizer else None,
                    "scheduler": scheduler.state_dict() if mine and scheduler else None,
                    "scaler": scaler.state_dict() if mine and scaler else None,
                    "averaged_model": averaged.state_dict() if mine and averaged is not None
                    else None,
                    "counters": dict(counters or {}), "rng": rng_state(),
                    "carried": carry.state_dict() if carry is not None else None}, tmp / STATE)
        (tmp / META).write_text(json.dumps({"torch": torch.__version__,
                                            "threads": torch.get_num_threads(),
                                            "digests": {} if mine else digests(objects),
                                            "own_state": not mine,
                                            **({} if mine else
                                               {"tensors": tensor_record(model)}),
                                            **({} if base is None else {"base": base}),
                                            **(meta or {})}, indent=1, default=str))

    return write_folder(path, fill, "checkpoint")


def user_code(name: str, fn: Callable, folder: Path, objects: dict[str, Any]) -> None:
    """Run a task's own save_state/restore_state on a checkpoint folder."""
    own_code(name, fn, folder, objects, receives="the checkpoint folder and the objects "
             "{model, optimizer, scheduler, scaler, sampler, step} (None where absent)")


def digests(objects: dict[str, Any]) -> dict[str, str]:
    """A fingerprint of each part of the training state (weights, optimizer state, schedule,
    scaler), to tell after a restore which part did not come back."""
    out = {}
    for name, obj in objects.items():
        if callable(getattr(obj, "state_dict", None)):
            h = hashlib.sha256()
            feed(obj.state_dict(), h)
            out[name] = h.hexdigest()[:16]
    return out


def feed(value: Any, h) -> None:
    """A state's values into a hash: tensors by dtype, shape and bytes, containers in order."""
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        h.update(str((t.dtype, tuple(t.shape))).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(value, dict):
        for k in sorted(value, key=str):
            h.update(str(k).encode())
            feed(value[k], h)
    elif isinstance(value, (list, tuple)):
        for v in value:
            feed(v, h)
    elif not callable(value):
        h.update(repr(value).encode())


def tensor_record(model: torch.nn.Module) -> dict[str, dict]:
    """Each tensor of the model's state: its shape, dtype and a digest of its values."""
    return model_record.tensor_record(model, feed)


def verify(path: str | Path) -> dict[str, dict]:
    """Check every file against the manifest; refuse anything missing, extra or changed."""
    return verify_folder(path, "checkpoint")


def load_state(path: str | Path) -> dict[str, Any]:
    """The non-weight state, loaded with `weights_only=True` after the manifest check, and
    checked against `schemas.CheckpointState` (counters never negative, random states of their
    types and lengths) before any of it is used."""
    verify(path)
    try:
        state = torch.load(Path(path) / STATE, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise WorkbookError(f"{path}/{STATE} needs arbitrary code to load; refused ({exc})",
                            "only load checkpoints whose provenance you know") from exc
    except (RuntimeError, EOFError, ValueError, OSError, RecursionError) as exc:
        raise WorkbookError(f"{path}/{STATE} cannot be read: {reason(exc)}",
                            "the checkpoint is damaged; resume from an earlier one") from None
    try:
        schemas.check(schemas.CheckpointState, state, Path(path) / STATE, "checkpoint state",
                      "the checkpoint is damaged; resume from an earlier one")
    except RecursionError:
        raise WorkbookError(f"{path}/{STATE} nests its values too deep to be a checkpoint "
                            "state", "resume from an intact checkpoint") from None
    return state


def load_meta(path: str | Path) -> dict[str, Any]:
    """meta.json of a verified checkpoint, parsed bounded and checked against
    `schemas.CheckpointMeta` (thread count 1..4096, the recorded task...)."""
    meta = Path(path) / META
    data = read_json(meta, "checkpoint meta")
    schemas.check(schemas.CheckpointMeta, data, meta, "checkpoint meta",
                  "the checkpoint is damaged; resume from an earlier one")
    return data


def load_weights(model: torch.nn.Module, path: Path, what: str) -> None:
    """Safetensors weights into `model` (no code runs); a file that does not fit the model, or
    is not safetensors at all, is refused with its name."""
    fix = f"load the {what} into the model of the task and options that wrote it"
    try:
        stored = schemas.safetensors_header(path)
    except (OSError, ValueError, WorkbookError) as exc:
        raise WorkbookError(f"{path} cannot be loaded into the model: {reason(exc, 300)}",
                            fix) from None
    own = model.state_dict()
    for name, entry in stored.items():
        why = schemas.tensor_mismatch(name, entry, own[name]) if name in own else None
        if why:  # load_state_dict would cast another dtype silently (fp16-rounded weights)
            raise WorkbookError(f"{path} cannot be loaded into the model: {why}", fix)
    try:
        missing, unexpected = load_model(model, str(path), strict=False)
    except (SafetensorError, RuntimeError, ValueError, OSError) as exc:
        raise WorkbookError(f"{path} cannot be loaded into the model: "
                            f"{reason(exc, 300)}", f"load the {what} into the "
                            "model of the task and options that wrote it") from None
    if missing or unexpected:
        raise WorkbookError(f"{what} {path.parent} does not fit this model (missing "
                            f"{missing[:3]}, unexpected {unexpected[:3]})", f"load the {what} "
                            "into the model of the task and options that wrote it")


def load_checkpoint(path: str | Path, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer | None = None, scheduler: Any = None,
                    scaler: Any = None, restore_rng: bool = True,
                    own: Callable | None = None, sampler: Any = None,
                    carry: Any = None, built: dict | None = None,
                    averaged: Any = None) -> dict[str, Any]:
    """Restore model (and optimizer, schedule, scaler, random states) in place; returns the
    counters and meta data. A checkpoint written by a task's own `save_state` is restored by
    its `restore_state` (`own`), then every part is checked against the digests taken when it
    was saved. The sampler and step are checked only when restore_state changed them: one that
    leaves them alone leaves them to the workbook, which restores the data position itself.
    `carry` gets back the carried state saved with it. `built`: the model's `tensor_record`
    as this process built it (taken here when the checkpoint records a base), to tell a base
    that differs from the writer's from a restore that failed."""
    state = load_state(path)
    meta = load_meta(path)
    if built is None and (meta.get("base") is not None or meta.get("tensors") is not None):
        built = tensor_record(model)
    if carry is not None:
        restore_carry(path, state, carry, model)
    objects = own_objects(model, optimizer, scheduler, scaler, sampler, averaged=averaged)
    if meta.get("own_state"):
        if own is None:
            raise WorkbookError(f"checkpoint {path} was written by a task's own save_state",
                                "restore it with the same task (its restore_state)")
        untouched = digests({k: objects[k] for k in ("sampler", "step")})
        try:
            user_code("restore_state", own, Path(path), objects)
        except WorkbookError as exc:  # e.g. load_state_dict refusing a rebuilt base's shapes
            other = model_record.rebuilt_base(meta, built)
            if other:
                raise WorkbookError(f"{exc.problem.rstrip(': ')}: {other}",
                                    model_record.BASE_FIX) from None
            raise
        handled = {k for k, v in digests({k: objects[k] for k in untouched}).items()
                   if v != untouched[k]}
        check_restored(path, {k: v for k, v in (meta.get("digests") or {}).items()
                              if k not in untouched or k in handled}, objects, meta, built)
        if restore_rng:
            set_rng_state(state["rng"], Path(path) / STATE)
        return {"counters": state["counters"], "meta": meta}
    try:
        load_weights(model, Path(path) / WEIGHTS, "checkpoint")
    except WorkbookError as exc:
        other = model_record.rebuilt_base(meta, built)
        if other:
            raise WorkbookError(f"{exc.problem}: {other}", model_record.BASE_FIX) from None
        raise
    for name, obj in (("optimizer", optimizer), ("scheduler", scheduler), ("scaler", scaler),
                      ("averaged_model", averaged)):
        if obj is None:
            continue
        if state.get(name) is None:
            raise WorkbookError(f"checkpoint {path} has no {name} state; training cannot resume "
                                "exactly", f"save the {name} with the checkpoint")
        why = schemas.optimizer_mismatch(state[name], obj) if name == "optimizer" else None
        if why:  # torch would cast it silently, or fail only at the first step
            raise WorkbookError(f"checkpoint {path}: the optimizer state does not fit this "
                                f"optimizer: {why}", "resume with the model, optimizer and "
                                "configuration that wrote it")
        try:
            obj.load_state_dict(state[name])
        except (ValueError, KeyError, RuntimeError) as exc:
            raise WorkbookError(f"checkpoint {path}: the {name} state does not fit ({exc})",
                                "resume with the configuration that wrote it") from None
    if restore_rng:
        set_rng_state(state["rng"], Path(path) / STATE)
    return {"counters": state["counters"], "meta": meta}


def restore_carry(path: str | Path, state: dict[str, Any], carry: Any,
                  model: torch.nn.Module) -> None:
    """Load the carried state saved with a checkpoint into `carry`, on the model's device."""
    if state.get("carried") is None:
        raise WorkbookError(f"checkpoint {path} holds no carried state, but the task carries "
                            "one between batches (Task.state)", "resume from a checkpoint "
                            "written by this task: its carried state is saved with it")
    device = next((p.device for p in model.parameters()), None)
    carry.load_state_dict(state["carried"], device)


def check_restored(path: str | Path, saved: dict[str, str], objects: dict[str, Any],
                   meta: dict | None = None, built: dict | None = None) -> None:
    """Name every part of the training state that a task's restore_state did not bring back
    as it was saved (weights, optimizer state such as Adam's moments, schedule, scaler,
    sampler, step); of the model, which tensors - and those of a base this process built
    otherwise than the writer (`built` against the base `meta` records) apart."""
    now = digests({k: v for k, v in objects.items() if k in saved})
    wrong = [k for k in now if now[k] != saved[k]]
    if not wrong:
        return
    problems, fixes = [], []
    found = model_record.model_difference(path, meta or {}, built,
                                          tensor_record(objects["model"])) \
        if "model" in wrong else None
    if found:
        problems.append(found[0])
        fixes.append(found[1])
        wrong.remove("model")
    if wrong:
        problems.append(
            f"the task's restore_state did not bring back the {', '.join(wrong)} state saved in "
            f"{path}" + (" (without the optimizer state, Adam's moments restart from zero and "
                         "the resumed run diverges from the uninterrupted one)"
                         if "optimizer" in wrong else "")
            + (" (the sampler's order after the resume is not the uninterrupted run's: "
               "examples are repeated or skipped)" if "sampler" in wrong else ""))
        fixes.append(f"save and restore the {', '.join(wrong)} state_dict in "
                     "save_state/restore_state")
    raise WorkbookError("; and ".join(problems), "; and ".join(fixes))


def tied_groups(model: torch.nn.Module) -> list[tuple[str, ...]]:
    """Names of parameters that are one tensor (tied weights, e.g. an output projection sharing
    the embedding matrix). A restore must keep every group: copy into the shared tensor, never
    replace one of its names with a new Parameter."""
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    return sorted(tuple(g) for g in groups.values() if len(g) > 1)


def checkpoint_bytes(path: str | Path) -> int:
    """Size of a checkpoint folder on disk."""
    return sum(f.stat().st_size for f in Path(path).iterdir())
