"""What the ranks of a launch share, for the DDP and the FSDP launches alike: joining the process
group, what every rank can see of the others (gathered objects, digests) and batch-norm statistics
averaged over the ranks."""

from __future__ import annotations

import datetime
import hashlib
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..base.errors import WorkbookError
from .devices import resolve_device


# --- what every rank can see of the others -------------------------------------------------
def gather(obj: Any) -> list[Any]:
    """`obj` of every rank, in rank order, on every rank (within the launch's own processes)."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def digest(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over names and bytes: equal digests mean bit-identical tensors."""
    h = hashlib.sha256()
    for name, t in sorted(tensors.items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


# --- batch norm across ranks -----------------------------------------------------------------
def batch_norms(model: nn.Module) -> list[nn.modules.batchnorm._BatchNorm]:
    return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
            and m.track_running_stats]


def bn_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {f"{name}.{key}": getattr(m, key).detach().cpu().clone()
            for name, m in model.named_modules() if m in batch_norms(model)
            for key in ("running_mean", "running_var")}


def sync_batch_norm(model: nn.Module, world: int, fault: str = "") -> dict[str, Any]:
    """Average every batch-norm running statistic over the ranks (SyncBatchNorm computes
    global statistics on CUDA; the buffers are averaged in any case), before evaluation and
    checkpointing. Returns what rank 0 needs to check it."""
    before = bn_buffers(model)
    for m in batch_norms(model):
        for key in ("running_mean", "running_var"):
            buf = getattr(m, key)
            if fault == "bn_rank0":  # the classic: rank 0's statistics copied everywhere
                dist.broadcast(buf, src=0)
            else:
                dist.all_reduce(buf)
                buf.div_(world)
    return {"before": gather(before), "after": gather(digest(bn_buffers(model)))}


def bn_check(sync: dict[str, Any], saved: dict[str, torch.Tensor] | None) -> dict[str, Any]:
    """Were the ranks' statistics different, identical after the sync, and is what was saved
    their mean?"""
    before = sync["before"]
    if not before[0]:
        return {"layers": 0}
    mean = {k: torch.stack([b[k] for b in before]).mean(0) for k in before[0]}
    spread = max(float((b[k] - before[0][k]).abs().max()) for b in before for k in mean)
    held = saved if saved is not None else {}
    off = max((float((held[k] - mean[k]).abs().max()) for k in mean if k in held),
              default=None)
    rank0 = max(float((before[0][k] - mean[k]).abs().max()) for k in mean)
    return {"layers": len(mean) // 2, "ranks_differed_by": spread,
            "rank0_vs_rank_mean": rank0,  # what saving rank 0's statistics would be off by
            "identical_after_sync": len(set(sync["after"])) == 1,
            "saved_vs_rank_mean": off}


# --- the process group -----------------------------------------------------------------------
def backend(device: str, world: int) -> str:
    """NCCL when every process has a GPU of its own, else gloo (the CPU, or processes sharing
    GPUs: NCCL refuses two ranks on one device)."""
    if device.startswith("cuda") and torch.cuda.device_count() >= world:
        return "nccl"
    return "gloo"


def join_launch(device_name: str, timeout_s: float) -> tuple[int, int, torch.device]:
    """This process's rank, the world and its device (one GPU per local rank, shared when
    there are fewer), with the process group joined (shared by the DDP and FSDP launches)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cuda = device_name.startswith("cuda")
    gpus = torch.cuda.device_count() if cuda else 0
    device = resolve_device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0')) % max(gpus, 1)}"
                            if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    if dist.is_initialized():  # the task's own code joined already (transformers'
        if (dist.get_rank(), dist.get_world_size()) != (rank, world):  # TrainingArguments)
            raise WorkbookError(f"the task's code joined a process group of rank "
                                f"{dist.get_rank()} in {dist.get_world_size()}, but torchrun "
                                f"launched rank {rank} of {world}",
                                "do not initialise torch.distributed while building the task")
        return rank, world, device
    dist.init_process_group(backend(device_name, world),
                            timeout=datetime.timedelta(seconds=timeout_s))
    return rank, world, device
