"""Checkpoints as folders: weights in safetensors, the rest loadable with `weights_only=True`,
and a manifest of sha256 digests. Written to a temporary folder and renamed, so a kill during a
save never leaves a half-written checkpoint under the final name."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_model, save_model

from .errors import WorkbookError

WEIGHTS = "model.safetensors"
STATE = "state.pt"
META = "meta.json"
MANIFEST = "manifest.json"


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


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` captured."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal.tolist()), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def save_checkpoint(path: str | Path, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer | None = None, scheduler: Any = None,
                    scaler: Any = None, counters: dict | None = None,
                    meta: dict | None = None) -> Path:
    """Save the full training state into a new folder `path` (never over an existing one)."""
    path = Path(path)
    if path.exists():
        raise WorkbookError(f"checkpoint {path} already exists",
                            "save under a new name; checkpoints are never overwritten")
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
    try:
        tmp.mkdir(parents=True)
        save_model(model, str(tmp / WEIGHTS))
        torch.save({"optimizer": optimizer.state_dict() if optimizer is not None else None,
                    "scheduler": scheduler.state_dict() if scheduler is not None else None,
                    "scaler": scaler.state_dict() if scaler is not None else None,
                    "counters": dict(counters or {}), "rng": rng_state()}, tmp / STATE)
        (tmp / META).write_text(json.dumps({"torch": torch.__version__,
                                            "threads": torch.get_num_threads(),
                                            **(meta or {})}, indent=1, default=str))
        manifest = {f.name: _sha256(f) for f in sorted(tmp.iterdir())}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        for f in tmp.iterdir():  # on disk before the rename makes the checkpoint visible
            with f.open("rb") as handle:
                os.fsync(handle.fileno())
        os.rename(tmp, path)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise WorkbookError(f"cannot write checkpoint {path}: {exc.strerror or exc}",
                            "free disk space or choose a writable folder before the campaign"
                            ) from exc
    return path


def verify(path: str | Path) -> dict[str, str]:
    """Check every file against the manifest; refuse anything missing, extra or changed."""
    path = Path(path)
    if not (path / MANIFEST).is_file():
        raise WorkbookError(f"{path} is not a checkpoint (no {MANIFEST})",
                            "point at a folder written by save_checkpoint")
    manifest = json.loads((path / MANIFEST).read_text())
    for name, digest in manifest.items():
        f = path / name
        if not f.is_file():
            raise WorkbookError(f"checkpoint {path} lacks {name}", "use an intact checkpoint")
        if _sha256(f) != digest:
            raise WorkbookError(f"{f} does not match its manifest (changed or truncated)",
                                "do not load it; use an intact checkpoint")
    return manifest


def load_state(path: str | Path) -> dict[str, Any]:
    """The non-weight state, loaded with `weights_only=True` after the manifest check."""
    verify(path)
    try:
        return torch.load(Path(path) / STATE, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise WorkbookError(f"{path}/{STATE} needs arbitrary code to load; refused ({exc})",
                            "only load checkpoints whose provenance you know") from exc


def load_checkpoint(path: str | Path, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer | None = None, scheduler: Any = None,
                    scaler: Any = None, restore_rng: bool = True) -> dict[str, Any]:
    """Restore model (and optimizer, schedule, scaler, random states) in place; returns the
    counters and meta data."""
    state = load_state(path)
    missing, unexpected = load_model(model, str(Path(path) / WEIGHTS), strict=False)
    if missing or unexpected:
        raise WorkbookError(f"checkpoint {path} does not fit this model (missing {missing[:3]},"
                            f" unexpected {unexpected[:3]})", "load it into the model of the "
                            "task that wrote it")
    for name, obj in (("optimizer", optimizer), ("scheduler", scheduler), ("scaler", scaler)):
        if obj is None:
            continue
        if state[name] is None:
            raise WorkbookError(f"checkpoint {path} has no {name} state; training cannot resume "
                                "exactly", f"save the {name} with the checkpoint")
        obj.load_state_dict(state[name])
    if restore_rng:
        set_rng_state(state["rng"])
    return {"counters": state["counters"],
            "meta": json.loads((Path(path) / META).read_text())}


def checkpoint_bytes(path: str | Path) -> int:
    """Size of a checkpoint folder on disk."""
    return sum(f.stat().st_size for f in Path(path).iterdir())
