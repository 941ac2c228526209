"""Memory counters per phase. CUDA: the caching allocator's counters (allocated and reserved are
different quantities and are never added). CPU: the live-tensor peak rebuilt from the profiler's
allocation events, and the process resident-set high-water mark, which is NOT tensor memory."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterable, Iterator

import torch
from torch.profiler import ProfilerActivity, profile

GIB = 1024**3


@dataclass
class MemoryReading:
    """Counters of one phase, in bytes. `None` where the device has no such counter."""

    counter: str  # "cuda-allocator" or "cpu-profiler"
    baseline_bytes: int  # live before the phase (CUDA: allocated; CPU: the given tensors)
    peak_allocated_bytes: int  # highest live-tensor bytes during the phase
    allocated_bytes: int  # live-tensor bytes at the end of the phase
    peak_reserved_bytes: int | None = None  # CUDA: highest bytes held by the caching allocator
    reserved_bytes: int | None = None
    alloc_retries: int | None = None  # CUDA: allocations retried after freeing the cache
    ooms: int | None = None  # CUDA: out-of-memory errors raised by the allocator
    rss_peak_bytes: int | None = None  # process resident-set high-water during the phase


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind these tensors (views and shared weights once)."""
    seen, total = set(), 0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        storage = t.untyped_storage()
        key = (storage.data_ptr(), t.device)
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def state_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                  extra: Iterable[torch.Tensor] = ()) -> list[torch.Tensor]:
    """Parameters, buffers, gradients and optimizer state: what lives across phases."""
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [p.grad for p in model.parameters() if p.grad is not None]
    if optimizer is not None:
        for state in optimizer.state.values():
            tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors + list(extra)


def _rss_reset() -> bool:
    """Reset the kernel's resident-set high-water mark for this process (Linux only)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _rss_peak() -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def live_peak_from_profile(prof: profile) -> tuple[int, int]:
    """(peak, end) of live CPU bytes relative to the start, from the profiler's allocation
    events in time order: allocations positive, frees negative."""
    events = [e for e in prof.profiler.kineto_results.events()
              if e.name() == "[memory]" and e.device_type().name.lower() == "cpu"]
    events.sort(key=lambda e: e.start_ns())
    current = peak = 0
    for e in events:
        current += e.nbytes()
        peak = max(peak, current)
    return peak, current


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Silence the profiler's C++ start/stop lines (they carry timestamps) on file descriptor 2."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class MeasureResult:
    """Filled in when the `measure` block ends (also when it raises)."""

    reading: MemoryReading | None = None


@contextlib.contextmanager
def measure(device: torch.device,
            baseline: Iterable[torch.Tensor] = ()) -> Iterator[MeasureResult]:
    """Measure one phase. On CPU `baseline` lists the tensors alive at the start that the phase
    works on (model state, batch); on CUDA the allocator already knows them."""
    out = MeasureResult()
    rss_ok = _rss_reset()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_stats(device)
        try:
            yield out
        finally:
            torch.cuda.synchronize(device)
            stats = torch.cuda.memory_stats(device)
            out.reading = MemoryReading(
                "cuda-allocator", before.get("allocated_bytes.all.current", 0),
                torch.cuda.max_memory_allocated(device), torch.cuda.memory_allocated(device),
                torch.cuda.max_memory_reserved(device), torch.cuda.memory_reserved(device),
                stats.get("num_alloc_retries", 0) - before.get("num_alloc_retries", 0),
                stats.get("num_ooms", 0) - before.get("num_ooms", 0),
                _rss_peak() if rss_ok else None)
        return
    start = storage_bytes(baseline)
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _quiet_stderr():
        prof.start()
    try:
        yield out
    finally:
        with _quiet_stderr():
            prof.stop()
        peak, end = live_peak_from_profile(prof)
        out.reading = MemoryReading("cpu-profiler", start, start + peak, start + end,
                                    rss_peak_bytes=_rss_peak() if rss_ok else None)


def rebased(reading: MemoryReading, base: int) -> MemoryReading:
    """A CPU reading of a phase made absolute: its counters (relative to the phase's start) plus
    the bytes alive at the start. CUDA readings are absolute already."""
    if reading.counter != "cpu-profiler":
        return reading
    return replace(reading, baseline_bytes=base, peak_allocated_bytes=base +
                   reading.peak_allocated_bytes, allocated_bytes=base + reading.allocated_bytes)


def cuda_overheads(device: torch.device) -> dict[str, int] | None:
    """What a prediction of tensor memory does not see on CUDA: the allocator's cache
    (reserved - allocated) and the CUDA context plus library workspaces (used - reserved)."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    return {"total_bytes": total, "context_and_workspaces_bytes": total - free - reserved,
            "cache_bytes": reserved - torch.cuda.memory_allocated(device)}


@functools.cache
def cublas_workspace_bytes(device: torch.device) -> int:
    """Bytes the cuBLAS and cuBLASLt workspaces hold in the caching allocator once a matmul
    has run on `device` (0 off CUDA). Fake tensors never see them (on an H200 with torch
    2.11, 33 MiB per cuBLAS handle, one for the forward's thread and one for autograd's: 97%
    of a small model's measured peak), and their size depends on the GPU, the build and
    CUBLAS_WORKSPACE_CONFIG, so they are measured: cleared, an fp32 matmul with its backward
    and a bf16 one with bias, read back."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return 0
    torch.cuda.synchronize(device)
    torch._C._cuda_clearCublasWorkspaces()
    before = torch.cuda.memory_allocated(device)
    full = torch.ones(64, 64, device=device, requires_grad=True)
    half = torch.ones(64, 64, device=device, dtype=torch.bfloat16)
    bias = torch.ones(64, device=device, dtype=torch.bfloat16)
    outputs = (full @ full, torch.addmm(bias, half, half))
    outputs[0].sum().backward()  # autograd's own thread holds its own handle and workspace
    torch.cuda.synchronize(device)
    held = torch.cuda.memory_allocated(device) - before
    return max(held - storage_bytes([full, full.grad, half, bias, *outputs]), 0)
