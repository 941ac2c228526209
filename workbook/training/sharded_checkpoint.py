"""Checkpoints of a sharded model: one DCP checkpoint every rank writes its shard of (planted:
rank 0 alone), what its metadata covers, and the files each process wrote."""

from __future__ import annotations

import io
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .loop import Stepper


class FileAudit:
    """Every file this process creates or renames under `root` (relative paths), through
    Python's audit hooks, as `replica.WriteAudit` but file by file."""

    _WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND

    def __init__(self, root: Path):
        self.root = str(root.resolve())
        self.paths: set[str] = set()
        sys.addaudithook(self._hook)

    def _hook(self, event: str, args: tuple) -> None:
        try:
            if event not in ("open", "os.rename") or not args or \
                    not isinstance(args[0], (str, Path)):
                return
            if event == "open":
                mode, flags = (args[1], args[2]) if len(args) > 2 else (None, 0)
                if not ((isinstance(mode, str) and any(c in mode for c in "wax+")) or
                        (isinstance(flags, int) and flags & self._WRITE_FLAGS)):
                    return
            path = os.path.abspath(str(args[1] if event == "os.rename" else args[0]))
            if path.startswith(self.root + os.sep):
                self.paths.add(os.path.relpath(path, self.root))
        except Exception:  # an audit hook that raises would fail the write it watches
            pass

    def under(self, folder: str) -> list[str]:
        """The final names this process wrote in `folder` (temporary names left out)."""
        names = {p[len(folder) + 1:] for p in self.paths if p.startswith(folder + os.sep)}
        return sorted(n for n in names if not n.endswith(".tmp") and ".partial" not in n)


def _trainer_bytes(state: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def coverage(path: Path) -> dict[str, Any]:
    """What a DCP checkpoint's metadata holds: per tensor the share of its elements some
    rank's chunk covers, and the files its chunks are in."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = FileSystemReader(str(path)).read_metadata()
    total = covered = 0
    short = []
    for fqn, item in meta.state_dict_metadata.items():
        if not isinstance(item, TensorStorageMetadata):
            continue
        size = int(torch.Size(item.size).numel())
        have = sum(int(torch.Size(c.sizes).numel()) for c in item.chunks)
        total, covered = total + size, covered + min(have, size)
        if have < size:
            short.append(fqn)
    files = sorted({info.relative_path for info in (meta.storage_data or {}).values()})
    return {"elements": total, "covered": covered, "short_tensors": len(short),
            "short_examples": short[:3], "files": files}


def save_sharded(path: Path, stepper: Stepper, trainer: dict[str, Any],
                 rank0_only: bool = False) -> None:
    """The model, optimizer and trainer state as one DCP checkpoint: every rank writes its own
    shard (`rank0_only`: the planted bug - only rank 0 saves, without the others)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(stepper.model, stepper.optimizer)
    state = {"model": msd, "optim": osd, "trainer": _trainer_bytes(trainer)}
    if not rank0_only:
        dcp.save(state, checkpoint_id=str(path))
    elif dist.get_rank() == 0:
        dcp.save(state, checkpoint_id=str(path), no_dist=True)
    dist.barrier()


def load_sharded(path: Path, stepper: Stepper) -> dict[str, Any]:
    """Load a DCP checkpoint into the sharded model and optimizer (every rank reads its own
    shard); returns the trainer state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(stepper.model, stepper.optimizer)
    state = {"model": msd, "optim": osd, "trainer": b""}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(stepper.model, stepper.optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    return torch.load(io.BytesIO(state["trainer"]), weights_only=True)
