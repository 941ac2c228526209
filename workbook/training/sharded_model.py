"""The model under FSDP2: the blocks `fully_shard` wraps, sharding in place, tied weights (untied,
tied again, watched at every forward), and the state one rank holds or every rank gathers."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..contract.task import Task
from .memory import storage_bytes


# --- sharding ---------------------------------------------------------------------------------
def blocks(task: Task, model: nn.Module) -> list[nn.Module]:
    """The modules `fully_shard` wraps one by one before the root, here and in the prediction
    (`sharding` imports it): the task's `checkpoint_blocks` rule (the one activation
    checkpointing uses), else a Hugging Face model's `_no_split_modules` classes, else the items
    of every `nn.ModuleList`; the outermost ones only (a block inside a block stays in its
    parent's group), never a container without forward (its items are taken instead)."""
    if task.checkpoint_blocks is not None:
        def pick(m: nn.Module) -> bool:
            return bool(task.checkpoint_blocks(m))
    elif getattr(model, "_no_split_modules", None):
        names = set(model._no_split_modules)

        def pick(m: nn.Module) -> bool:
            return type(m).__name__ in names
    else:
        items = {id(m) for lst in model.modules() if isinstance(lst, nn.ModuleList)
                 for m in lst}

        def pick(m: nn.Module) -> bool:
            return id(m) in items
    chosen, prefixes = [], []
    for name, module in model.named_modules():
        if module is model or any(name.startswith(p) for p in prefixes):
            continue
        if pick(module) and not isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            chosen.append(module)
            prefixes.append(name + ".")
    return chosen


def shard_model(task: Task, model: nn.Module, precision: str = "fp32",
                mesh: Any = None, offload: bool = False) -> nn.Module:
    """FSDP2 full sharding in place, the same in the launches and the prediction: `fully_shard`
    on every block, then on the root; bf16 parameters and gradient reduction for a bf16 plan;
    with `offload`, FSDP2's `CPUOffloadPolicy` (the sharded state in host memory)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    options: dict[str, Any] = {}
    if precision == "bf16":
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                    reduce_dtype=torch.bfloat16)
    if offload:
        options["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    for block in blocks(task, model):
        fully_shard(block, mesh=mesh, **options)
    fully_shard(model, mesh=mesh, **options)
    return model


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, attr = name.rpartition(".")
    return (model.get_submodule(path) if path else model), attr


def untie(model: nn.Module, groups: list[list[str]]) -> None:
    """Every name of a tied group but the first gets its own copy (a model built untied)."""
    for first, *others in groups:
        weight = _owner(model, first)
        weight = getattr(*weight)
        for name in others:
            module, attr = _owner(model, name)
            setattr(module, attr, nn.Parameter(weight.detach().clone(), weight.requires_grad))


def tie(model: nn.Module, groups: list[list[str]]) -> None:
    """Tie every group again to its first name's parameter (the planted bug does this AFTER
    `fully_shard`: FSDP gathers and updates the parameter it registered, not the new one)."""
    for first, *others in groups:
        weight = getattr(*_owner(model, first))
        for name in others:
            module, attr = _owner(model, name)
            setattr(module, attr, weight)


class TieWatch:
    """Forward pre-hooks on the owners of tied weights: is the tensor every owner computes with
    one and the same (its storage), at every forward?"""

    def __init__(self, model: nn.Module, groups: list[list[str]]):
        self.groups, self.split = groups, set()
        self.forwards = 0
        self.handles = []
        for g, names in enumerate(groups):
            for name in names:
                module, attr = _owner(model, name)
                self.handles.append(module.register_forward_pre_hook(
                    lambda m, args, g=g, name=name, attr=attr: self._seen(g, name, m, attr)))
        self.now: dict[int, dict[str, int]] = {}

    def _seen(self, g: int, name: str, module: nn.Module, attr: str) -> None:
        t = getattr(module, attr)
        local = t.to_local() if hasattr(t, "to_local") else t
        self.now.setdefault(g, {})[name] = local.untyped_storage().data_ptr()
        if len(self.now[g]) == len(self.groups[g]):
            self.forwards += 1
            if len(set(self.now[g].values())) > 1:
                self.split.add(g)
            self.now[g] = {}

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


# --- state across ranks -----------------------------------------------------------------------
def local_tensor(t: Any) -> Any:
    """A sharded tensor's (DTensor's) local shard; any other tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


def local_state(model: nn.Module, optimizer: torch.optim.Optimizer | None,
                extra: list[torch.Tensor] = ()) -> list[torch.Tensor]:
    """This rank's own tensors of the sharded model: parameter and gradient shards, buffers,
    optimizer state shards (the DTensors' local tensors), and the unsharded parameters FSDP
    holds at this moment (the root's after a forward without backward)."""
    from torch.distributed.fsdp import FSDPModule

    tensors = [local_tensor(t) for t in (*model.parameters(), *model.buffers())]
    for module in model.modules():  # FSDP2's own storages (private: read where present)
        state = module._get_fsdp_state() if isinstance(module, FSDPModule) else None
        for group in getattr(state, "_fsdp_param_groups", None) or ():
            for param in getattr(group, "fsdp_params", ()):
                tensors += [t for t in (getattr(param, "_sharded_param_data", None),
                                        getattr(param, "_unsharded_param", None))
                            if isinstance(t, torch.Tensor)]
    tensors += [local_tensor(p.grad) for p in model.parameters() if p.grad is not None]
    if optimizer is not None:
        for state in optimizer.state.values():
            tensors += [local_tensor(v) for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors + list(extra)


def live_bytes(tensors: list[torch.Tensor]) -> int:
    """`memory.storage_bytes` of these tensors, leaving out storages FSDP has freed (an
    unsharded parameter between forward and backward whose storage was resized to 0)."""
    kept = []
    for t in tensors:
        try:
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
                t.untyped_storage().data_ptr()
                kept.append(t)
        except RuntimeError:
            continue
    return storage_bytes(kept)


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer | None = None
               ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The whole model (and optimizer) state gathered from every rank's shards, on the CPU, on
    rank 0 (a collective: every rank calls it; the others get empty dicts). Optimizer tensors
    are flattened to `fqn/key` names."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    if optimizer is None:
        return get_model_state_dict(model, options=options), {}
    msd, osd = get_state_dict(model, optimizer, options=options)
    flat = {f"{fqn}/{key}": v.detach().reshape(-1) if v.dim() == 0 else v
            for fqn, state in osd.get("state", {}).items()
            for key, v in state.items() if isinstance(v, torch.Tensor)}
    return msd, flat
