"""How far one set of tensors (a gradient, weights) is from a reference, judged on the scale of
the whole set: a parameter whose gradient is zero in exact arithmetic (an attention key bias:
softmax ignores a per-query constant) holds only rounding noise, which divided by its own
near-zero size would read as a large deviation. Empty tensors (a rank's empty FSDP2 shard of a
1-element bias) count as equal."""

from __future__ import annotations

import torch


def _largest(tensors: dict[str, torch.Tensor]) -> float:
    return max((float(t.detach().float().abs().max()) for t in tensors.values() if t.numel()),
               default=0.0)


def difference_by_name(a: dict[str, torch.Tensor],
                       b: dict[str, torch.Tensor]) -> dict[str, float]:
    """{name: largest absolute difference} over the names both hold (0 for empty tensors)."""
    return {k: float((a[k].detach().float() - b[k].detach().float()).abs().max())
            if b[k].numel() else 0.0 for k in b if k in a}


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest absolute difference between tensors of the same name."""
    return max(difference_by_name(a, b).values(), default=0.0)


def relative_deviation(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest difference of `a` from the reference `b`, relative to the largest value in
    all of `b` (the whole update's gradient scale)."""
    return max_difference(a, b) / max(_largest(b), 1e-12)

