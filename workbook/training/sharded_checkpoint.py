"""Checkpoints of a sharded model: one DCP checkpoint every rank writes its shard of (planted:
rank 0 alone) and what its metadata covers."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .loop import Stepper


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
