"""Memory traces of a phase, operator by operator and layer by layer, and what carries them from
fake runs of a deep model at `TRACE_DEPTHS` layers to its full depth (the campaign model is
never run there); what the fake-tensor trackers (`fake_phases`, `sharded_tracker`) share."""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

TRACE_DEPTHS = (3, 4)  # a deep campaign model's memory is traced at these depths


def layer_list(model: nn.Module, layers: int) -> str | None:
    """The tracker's name ("<RootClass>.<path>") of the one `nn.ModuleList` of `layers`
    modules of one type - the layer stack - else None."""
    found = [name for name, m in model.named_modules() if isinstance(m, nn.ModuleList)
             and len(m) == layers and len({type(c) for c in m}) == 1]
    return f"{type(model).__name__}.{found[0]}" if len(found) == 1 else None


def _segments(trace: list) -> list[tuple[int | None, list]]:
    """Consecutive operators of the same layer (None: outside the layer stack)."""
    out: list[tuple[int | None, list]] = []
    for layer, figures in trace:
        if out and out[-1][0] == layer:
            out[-1][1].append(figures)
        else:
            out.append((layer, [figures]))
    return out


def _roles(trace: list, depth: int) -> list[tuple[str, list]]:
    """The segments with the middle layers of each pass over the stack gathered into one
    "mid" item (a list of segments in the order run); first and last layers and the
    operators outside the stack keep their own items."""
    out: list[tuple[str, list]] = []
    for layer, figures in _segments(trace):
        role = ("outside" if layer is None else "first" if layer == 0
                else "last" if layer == depth - 1 else "mid")
        if role == "mid" and out and out[-1][0] == "mid":
            out[-1][1].append(figures)
        else:
            out.append((role, [figures] if role == "mid" else figures))
    return out


def layer_of(parents, layers: str, backward: bool) -> int | None:
    """The index of the layer of the stack `layers` (a tracker name, `layer_list`) the current
    operator runs in, from the module tracker's `parents`, else None. In backward the tracker
    leaves a layer among the parents until its inputs' gradients are done, so the layers being
    differentiated are the later ones: the current is the lowest."""
    prefix = layers + "."
    inside = [p[len(prefix):].split(".", 1)[0] for p in parents if p.startswith(prefix)]
    if not inside:
        return None
    return (min if backward else max)(int(k) for k in inside)


def attach_gaps(trace: list) -> list:
    """The trace with every stretch of operators outside the stack that runs between layer k
    and layer k +- 1 given to layer k: under FSDP2 a block's reshard after its forward
    (and the hooks around it) runs after the module tracker has left the block and before the
    next one is entered, a gap of the same operators after every layer; given to the layer it
    ends, the stack's passes line up layer for layer again."""
    out = list(trace)
    i = 0
    while i < len(out):
        if out[i][0] is None and i > 0 and out[i - 1][0] is not None:
            j = i
            while j < len(out) and out[j][0] is None:
                j += 1
            if j < len(out) and out[j][0] is not None and \
                    abs(out[j][0] - out[i - 1][0]) == 1:
                layer = out[i - 1][0]
                out[i:j] = [(layer, figures) for _, figures in out[i:j]]
            i = j
        else:
            i += 1
    return out


def carried(shallow: list, deeper: list, depth: int, key: Callable[[Any], Any] = sum,
            stretch: Callable[[list, list], list | None] | None = None
            ) -> list[list[int]] | None:
    """The operators of one phase that can hold its peak at `depth` layers, each with its
    memory (per category) carried from operator traces at `TRACE_DEPTHS` layers (`shallow`,
    `deeper`: lists of (layer index or None, figures per category)); the peak under any
    measure that is linear in the categories is the largest of them by that measure (`key`,
    which also picks the largest operator of a stretch outside the stack whose length changes
    with the depth). See `extrapolate`. `stretch(x, y)`, when given, pairs the operators of
    such a stretch instead (a list of (shallower, deeper) figures to carry, None when they
    cannot be paired). None when the traces do not line up."""
    a, b = _roles(shallow, TRACE_DEPTHS[0]), _roles(deeper, TRACE_DEPTHS[1])
    if [r for r, _ in a] != [r for r, _ in b]:
        return None
    more = depth - TRACE_DEPTHS[1]
    candidates: list[list[int]] = []

    def carry(x, y, extra):  # y at the deeper depth, x one layer shallower
        return [yi + more * (yi - xi) + ei for xi, yi, ei in zip(x, y, extra, strict=True)]

    zero = [0] * len(a[0][1][0] if a[0][0] != "mid" else a[0][1][0][0])
    for (role, x), (_, y) in zip(a, b, strict=True):
        if role == "mid":
            if len(x) != 1 or len(y) != 2 or not len(x[0]) == len(y[0]) == len(y[1]):
                return None
            for first3, first4, second4 in zip(x[0], y[0], y[1], strict=True):
                candidates.append(carry(first3, first4, zero))  # first middle layer
                # the last middle layer: the first's growth per layer of depth, and per
                # position in the stack the second's lead over the first
                candidates.append([s4 + more * (f4 - f3) + more * (s4 - f4) for f3, f4, s4
                                   in zip(first3, first4, second4, strict=True)])
        elif len(x) == len(y):
            candidates += [carry(xi, yi, zero) for xi, yi in zip(x, y, strict=True)]
        elif role == "outside" and stretch is not None:
            pairs = stretch(x, y)
            if pairs is None:
                return None
            candidates += [carry(xi, yi, zero) for xi, yi in pairs]
        elif role == "outside":
            def largest(t):
                return max(t, key=key)
            for pick in (lambda t: t[0], largest, lambda t: t[-1]):
                candidates.append(carry(pick(x), pick(y), zero))
        else:
            return None
    return candidates or None


def extrapolate(shallow: list, deeper: list, depth: int) -> tuple[int, ...] | None:
    """The memory (per category) at the peak of one phase of the model at `depth` layers, from
    operator traces at `TRACE_DEPTHS` layers (`shallow`, `deeper`: lists of (layer index or
    None, figures per category)). Each operator's memory is linear in the depth (what one more
    layer keeps alive) and, inside the stack, in the layer's position (what each layer before
    it left); the peak is the largest operator at `depth`, not the peak extrapolated (peaks of
    different operators grow at different rates: under bf16 autocast the forward's moves from
    the loss to the last layer past 14 layers of a 7 B Llama). Outside the stack a stretch whose
    length changes with the depth (the optimizer's per-parameter steps) is carried by its first,
    largest and last operator. None when the traces do not line up (`carried`)."""
    candidates = carried(shallow, deeper, depth)
    return tuple(max(candidates, key=sum)) if candidates else None


class _NoHook:
    """The stand-in handle of a frozen parameter's gradient hooks: it has none to remove."""

    def remove(self) -> None:
        pass


def frozen_without_hooks(tracker: Any, module: torch.nn.Module) -> None:
    """Mark `module`'s frozen parameters as hooked, so a tracker installs no gradient hook on
    them: the stock tracker hooks every parameter, and a frozen one (a LoRA or QLoRA base)
    refuses a hook. A frozen parameter gets no gradient, so nothing of it goes uncounted."""
    handles = tracker._param_to_grad_hook_handles
    for param in module.parameters():
        if not param.requires_grad and handles.get(param, None) is None:
            handles[param] = (_NoHook(), _NoHook())
