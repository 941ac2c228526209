"""What the ranks of a launch share, for the DDP and the FSDP launches alike: joining the process
group, what every rank can see of the others (gathered objects, digests), the files each process
wrote and batch-norm statistics averaged over the ranks."""

from __future__ import annotations

import datetime
import hashlib
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from ..base.errors import WorkbookError
from ..storage.files import write_json
from .devices import resolve_device


# --- what this process writes ---------------------------------------------------------------
class WriteAudit:
    """Every path this process creates, writes, renames or removes under `root` (relative),
    seen through Python's audit hooks (PEP 578): the workbook's writes all end in a rename, so
    even files written by C++ code are seen when they land."""

    EVENTS = ("open", "os.rename", "os.mkdir", "os.remove", "shutil.rmtree")
    _WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND

    def __init__(self, root: Path):
        self.root = str(root.resolve())
        self.paths: set[str] = set()
        sys.addaudithook(self._hook)

    def _hook(self, event: str, args: tuple) -> None:
        try:
            self._record(event, args)
        except Exception:  # an audit hook that raises would fail the write it watches
            pass

    def _record(self, event: str, args: tuple) -> None:
        if event not in self.EVENTS or not args or not isinstance(args[0], (str, Path)):
            return
        if event == "open":
            mode, flags = (args[1], args[2]) if len(args) > 2 else (None, 0)
            writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or \
                (isinstance(flags, int) and flags & self._WRITE_FLAGS)
            if not writes:
                return
        target = args[1] if event == "os.rename" else args[0]
        path = os.path.abspath(str(target))
        if path.startswith(self.root + os.sep):
            self.paths.add(os.path.relpath(path, self.root))

    def under(self, folder: str) -> list[str]:
        """The final names this process wrote in `folder` (temporary names left out)."""
        names = {p[len(folder) + 1:] for p in self.paths if p.startswith(folder + os.sep)}
        return sorted(n for n in names if not n.endswith(".tmp") and ".partial" not in n)


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


def now(device: torch.device) -> float:
    """The time once the device's queued work is done (a CUDA device is synchronised first)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


# --- the process group -----------------------------------------------------------------------
def check_world(path: Path, written: int, world: int) -> None:
    """Refuse a checkpoint written by another number of processes than this launch has."""
    if written != world:
        raise WorkbookError(f"checkpoint {path} was written by {written} processes, this "
                            f"launch has {world}", f"resume with --nproc_per_node={written}")


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


def in_launch(spec: Any, result: Path,
              body: Callable[[int, int, torch.device, WriteAudit], dict[str, Any]],
              written: Callable[[str], str] = str) -> None:
    """One run of a launch, DDP or FSDP alike (torchrun set RANK, WORLD_SIZE, LOCAL_RANK): the
    process group joined (or kept from the run before it in this process), `body(rank, world,
    device, audit)` run, the paths every rank wrote under the result's folder (each as
    `written` names it) gathered, and rank 0's result with them written to `result`. The group
    stays joined for the next run (`leave_launch`): joined anew, a fast rank could meet the
    other's addresses of the group before."""
    rank, world, device = join_launch(spec.device, spec.collective_timeout_s)
    audit = WriteAudit(result.parent)
    out = body(rank, world, device, audit)
    writers = gather(sorted({written(path) for path in audit.paths}))
    if rank == 0:
        write_json(result, {**out, "writes": writers})
    dist.barrier()


def leave_launch() -> None:
    """Leave the process group the runs of this process shared, however they ended."""
    if dist.is_initialized():
        dist.destroy_process_group()
