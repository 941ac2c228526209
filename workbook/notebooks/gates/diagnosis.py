"""What a failing or warning gate names in the model: the first module with a non-finite
output, why an example's eval output depends on its batch, weight decay on norms and biases."""

from __future__ import annotations

from typing import Any, Callable

import torch

from ...contract.task import Task, adamw


def first_nonfinite_module(model: torch.nn.Module, run: Callable[[], Any]) -> str | None:
    """Re-run a forward with hooks and name the first module whose output is not finite."""
    found: list[str] = []

    def hook(name):
        def check(_module, _inputs, output):
            if not found and isinstance(output, torch.Tensor) and output.is_floating_point() \
                    and not torch.isfinite(output).all():
                found.append(name or type(model).__name__)
        return check
    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules()]
    try:
        with torch.no_grad():
            run()
    except Exception:  # the original error is already reported
        pass
    finally:
        for h in handles:
            h.remove()
    return found[0] if found else None


def companion_causes(task: Task, model: torch.nn.Module,
                     padded: tuple[int, int]) -> list[str]:
    """The causes that apply to this model when an example's eval output changes with the
    other examples of its batch (only the ones it can have)."""
    causes = []
    norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    if norms:
        causes.append(f"batch norm in training behaviour during evaluation ({len(norms)} "
                      "batch-norm layer(s); one that ignores eval() computes batch statistics)")
    if padded[0] != padded[1]:
        causes.append(f"padding reaches the output (the batch was padded to {padded[0]} "
                      f"and to {padded[1]} positions): check that the model gets the "
                      "attention mask" + ("" if "attention_mask" in task.model_inputs else
                                          " - model_inputs does not pass it") +
                      ", the padding side, and position ids derived from the mask")
    if not causes:
        causes.append("a layer that mixes examples of a batch (batch statistics, a shared "
                      "cache, or a reduction over the batch dimension)")
    return causes


NORM_LAYERS = (torch.nn.LayerNorm, torch.nn.GroupNorm, torch.nn.LocalResponseNorm,
               torch.nn.modules.batchnorm._NormBase, *((torch.nn.RMSNorm,)
                                                      if hasattr(torch.nn, "RMSNorm") else ()))


def norms_and_biases(model: torch.nn.Module) -> dict[int, str]:
    """The parameters the common convention keeps out of weight decay, by id: every 1-D
    parameter (biases, norm scales) and every parameter of a normalisation layer (a torch norm
    or a module whose class name ends in "Norm", as nanoGPT's LayerNorm)."""
    out: dict[int, str] = {}
    for mod_name, module in model.named_modules():
        norm = isinstance(module, NORM_LAYERS) or type(module).__name__.endswith("Norm")
        for name, p in module.named_parameters(recurse=False):
            if norm or p.dim() < 2:
                out.setdefault(id(p), f"{mod_name}.{name}" if mod_name else name)
    return out


def decay_on_norms(task: Task, model: torch.nn.Module,
                   optimizer: torch.optim.Optimizer) -> str | None:
    """A note (never a finding: the gate passes) that the task's optimizer applies weight
    decay > 0 to norm weights and biases: conventions differ - torchvision's reference recipe
    decays every parameter by default, nanoGPT and the Hugging Face Trainer decay only tensors
    of 2 or more dims. The sentence naming them, or None. The workbook's own default
    (PyTorch's AdamW over every parameter) is not noted: it is no choice the task made."""
    if task.build_optimizer is adamw:
        return None
    excluded = norms_and_biases(model)
    decayed: dict[str, float] = {}
    for group in optimizer.param_groups:
        wd = float(group.get("weight_decay", 0.0) or 0.0)
        for p in group["params"]:
            if wd > 0 and id(p) in excluded:
                decayed.setdefault(excluded[id(p)], wd)
    if not decayed:
        return None
    names = list(decayed)
    rates = sorted(set(decayed.values()))
    return (f"note: weight decay {'/'.join(f'{r:g}' for r in rates)} applies to {len(names)} "
            f"norm weights and biases ({', '.join(names[:4])}"
            f"{', ...' if len(names) > 4 else ''}) - a convention, not an error "
            "(torchvision's reference recipe decays everything by default; nanoGPT and HF "
            "Trainer exclude them): to exclude them, put the parameters with p.dim() < 2 (and "
            "those of norm layers) in a group with weight_decay=0.0")
