"""Which tensors of a model came back from a checkpoint. Each tensor's shape, dtype and digest
are recorded with the checkpoint - the model as written, and as the writing process built it
(its base) - so a restore that failed (a tensor the restore did not bring back) is told from a
resumed process that built another base (a tensor whose build already differed)."""

from __future__ import annotations

import hashlib
from typing import Any, Callable

import torch

BASE_FIX = ("build the same base in every process: pin what the model factory reads (a Hub "
            "model's revision=<commit>, a vocabulary saved with the run instead of built from "
            "the data, no environment variable), or save the base's tensors in save_state too")
RESTORE_FIX = "save and restore the model state_dict in save_state/restore_state"


def tensor_record(model: torch.nn.Module, feed: Callable[[Any, Any], None]) -> dict[str, dict]:
    """Each tensor of the model's state: its shape, dtype and a digest of its values (`feed`
    puts a value into a hash)."""
    out = {}
    for name, t in model.state_dict().items():
        h = hashlib.sha256()
        feed(t, h)
        out[name] = {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."),
                     "digest": h.hexdigest()[:16]}
    return out


def differing(a: dict[str, dict], b: dict[str, dict]) -> list[str]:
    """Names whose entries differ between two records (or are in one only), shapes first."""
    names = [n for n in dict.fromkeys([*a, *b]) if a.get(n) != b.get(n)]
    return sorted(names, key=lambda n: (a.get(n, {}).get("shape") ==
                                        b.get(n, {}).get("shape"),))


def _shape(entry: dict | None) -> str:
    return "absent" if entry is None else "x".join(map(str, entry["shape"])) or "scalar"


def shown(names: list[str], now: dict, then: dict, most: int = 3) -> str:
    """The first tensors named, with their shapes now against `then` where those differ."""
    said = [f"{n} {_shape(now.get(n))} against {_shape(then.get(n))}"
            if _shape(now.get(n)) != _shape(then.get(n)) else n for n in names[:most]]
    return ", ".join(said) + (f" and {len(names) - most} more" if len(names) > most else "")


def rebuilt_base(meta: dict, built: dict | None) -> str:
    """'' unless the checkpoint records the base it was written from and the model this
    process built differs from it; else which tensors, with their shapes."""
    base = meta.get("base")
    if base is None or built is None:
        return ""
    other = differing(built, base)
    if not other:
        return ""
    return (f"the base the resumed process built differs from the one the checkpoint was "
            f"written from: {len(other)} of its {len(base)} tensors were built otherwise ("
            + shown(other, built, base) + ": this process's shapes against the writer's)")


def model_difference(path: Any, meta: dict, built: dict | None, now: dict
                     ) -> tuple[str, str] | None:
    """(problem, fix) for a model that a task's restore_state did not bring back as saved:
    the tensors that differ, split into those of a rebuilt base that differs (this process
    built them otherwise than the writer) and those the restore did not bring back. None when
    the checkpoint holds no per-tensor record (written before it was kept)."""
    saved = meta.get("tensors")
    if saved is None:
        return None
    differ = differing(now, saved)
    if not differ:
        return None
    base = meta.get("base")
    other = set(differing(built, base)) if base is not None and built is not None else set()
    rebuilt = [n for n in differ if n in other]
    failed = [n for n in differ if n not in other]
    exact = len(saved) - len(differ)
    problems, fixes = [], []
    if rebuilt:
        problems.append(f"the base the resumed process built differs from the one the "
                        f"checkpoint was written from: {len(rebuilt)} tensors that restore_state "
                        f"does not bring back were built otherwise (" + shown(rebuilt, built, base)
                        + ": this process's shapes against the writer's), while restore_state "
                        f"brought back {exact} of the {len(saved)} model tensors exactly")
        fixes.append(BASE_FIX)
    if failed:
        problems.append(f"the task's restore_state did not bring back {len(failed)} of the "
                        f"{len(saved)} model tensors saved in {path} ("
                        + shown(failed, now, saved) + ")"
                        + ("" if base is not None else " - whether the resumed process built "
                           "the writer's base is not known (the checkpoint records none)"))
        fixes.append(RESTORE_FIX)
    return "; and ".join(problems), "; and ".join(fixes)
