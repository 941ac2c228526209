"""The tracker behind the sharded prediction: FSDP2's memory tracker with one peak per phase and
every operator's bytes by kind, and the arithmetic that carries such a trace to another depth or
world size."""

from __future__ import annotations

from torch import nn

from . import traces

BREAKDOWN = ("sharded_state", "unsharded_params", "unsharded_grads", "activations", "temporaries",
             "collective_buffers", "buffers_and_inputs")


def tracker_class():
    """The phase tracker, made on first use (the FSDP tools import torch.distributed)."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType

    sharded = (_FSDPRefType.SHARDED_PARAM, _FSDPRefType.SHARDED_GRAD, _FSDPRefType.OPT)
    groups = {"sharded_state": sharded,
              "unsharded_params": (_FSDPRefType.UNSHARDED_PARAM,),
              "unsharded_grads": (_FSDPRefType.UNSHARDED_GRAD,),
              "activations": (_FSDPRefType.ACT,), "temporaries": (_FSDPRefType.TEMP,),
              "collective_buffers": (_FSDPRefType.ALL_GATHER, _FSDPRefType.REDUCE_SCATTER),
              "buffers_and_inputs": (_FSDPRefType.BUFFER, _FSDPRefType.INP)}

    class ShardedPhaseTracker(FSDPMemTracker):
        """FSDPMemTracker with a peak per phase of the bytes one GPU holds, and each phase's
        memory as (bytes that do not depend on the world size, bytes of the sharded state)
        per operator, so other world sizes follow from one run (the sharded state - sharded
        parameters, their gradients, the optimizer state and its step's temporaries - scales
        as 1/N; activations, unsharded parameters and gradients and the collectives' full-size
        buffers do not). With `offload` the sharded state lives in host memory (FSDP2's
        CPUOffloadPolicy) and is not on the GPU."""

        def __init__(self, model: nn.Module, optimizer, offload: bool,
                     layers: str | None = None):
            super().__init__(model, optimizer)
            self.offload = offload
            self.phase_peak, self.phase_snapshot, self.points = 0, {}, []
            self.quiet = 0
            # the tracker's name of the layer stack: record every operator's memory by kind
            # (`TRACE_KINDS`) with the layer it runs in (`trace`), to carry it to another depth
            self.layers, self.trace, self.op = layers, [], "begin"

        def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
            traces.frozen_without_hooks(self, module)  # a frozen base takes no gradient hook
            return super()._track_module_params_and_buffers(module, install_grad_hooks)

        def _kinds(self) -> tuple[int, ...]:
            snaps = self._curr_mem_snap.values()
            out = [sum(int(snap.get(k, 0)) for snap in snaps for k in keys)
                   for keys in groups.values()]
            total = sum(int(snap.get("Total", 0)) for snap in snaps)
            return (*out, total - sum(out))

        def _record(self, outside: bool = False, op: str | None = None) -> None:
            if self.layers is not None:
                layer = None if outside else traces.layer_of(
                    self._mod_tracker.parents, self.layers, self._mod_tracker.is_bw)
                self.trace.append((layer, _Op(self._kinds(), op or self.op)))

        def _split(self) -> tuple[int, int]:
            fixed = shard = 0
            for snap in self._curr_mem_snap.values():
                s = sum(snap.get(k, 0) for k in sharded)
                shard += s
                fixed += snap.get("Total", 0) - s
            return fixed, shard

        def begin(self) -> None:
            """A phase starts: its peak, breakdown, points and trace from what lives now."""
            self.points, self.phase_peak, self.trace = [], -1, []
            self._update_peak_stats(None, op="begin")

        def _update_peak_stats(self, peak_state, op: str | None = None) -> None:
            # the stock tracker scans every module's statistics per operator (a weak dict of
            # modules: most of a 7 B step's time); only the phase peaks are read here
            point = self._split()
            self.points.append(point)
            self._record(outside=op == "begin", op=op)
            on_gpu = point[0] if self.offload else point[0] + point[1]
            if on_gpu > self.phase_peak:
                self.phase_peak = on_gpu
                self.phase_snapshot = traced_breakdown(self._kinds(), self.offload)

        def __enter__(self):
            # DTensor's sharding propagation runs each optimizer-step op once more on fake
            # tensors of the global (unsharded) shape, in the active fake mode: shapes only,
            # never allocated on a GPU, so not tracked (else a clip_grad_norm_ over a 7 B
            # model's gradients counts its whole unsharded size)
            from torch.distributed.tensor._sharding_prop import ShardingPropagator

            if self._depth == 0:
                # and DTensor caches its sharding propagation (off when it sees a fake mode, for
                # symbolic shapes; these shapes are all concrete)
                from torch.distributed.tensor import _dispatch

                self._saved_tracing = _dispatch._are_we_tracing
                _dispatch._are_we_tracing = lambda: False
                original = ShardingPropagator._propagate_tensor_meta_non_cached
                tracker = self

                def quiet(prop, op_schema):
                    tracker.quiet += 1
                    try:
                        return original(prop, op_schema)
                    finally:
                        tracker.quiet -= 1
                self._saved_propagation = original
                ShardingPropagator._propagate_tensor_meta_non_cached = quiet
            return super().__enter__()

        def __exit__(self, *args):
            from torch.distributed.tensor._sharding_prop import ShardingPropagator

            super().__exit__(*args)
            if self._depth == 0:
                from torch.distributed.tensor import _dispatch

                ShardingPropagator._propagate_tensor_meta_non_cached = self._saved_propagation
                _dispatch._are_we_tracing = self._saved_tracing

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if self.quiet:
                return func(*args, **(kwargs or {}))
            self.op = str(func)
            return super().__torch_dispatch__(func, types, args, kwargs)

        def _fsdp_state_pre_forward(self, fsdp_mod, orig):
            inner = super()._fsdp_state_pre_forward(fsdp_mod, orig)

            def again(*args, **kwargs):
                # the next micro-batch or the evaluation: start the module statistics afresh
                # (the stock tracker refuses a second forward of the root)
                if fsdp_mod is self._root_mod and fsdp_mod in self.memory_tracking and \
                        not self._mod_tracker.is_bw:
                    self.reset_mod_stats()
                return inner(*args, **kwargs)
            return again

    return ShardedPhaseTracker


# what a sharded trace records of every operator: the breakdown's kinds and the bytes the
# tracker counts in no kind
TRACE_KINDS = (*BREAKDOWN, "other")


def fixed_and_sharded(kinds) -> tuple[int, int]:
    """(bytes that do not depend on the world size, bytes of the sharded state) of a traced
    operator (`TRACE_KINDS`)."""
    return sum(kinds) - kinds[0], kinds[0]


def gpu_bytes(offload: bool, scale: float | None = None):
    """The bytes one GPU holds at a traced operator; with `scale`, at another world size (the
    sharded state scaled by `scale`, as `ShardedRun.at` does)."""
    def on_gpu(kinds) -> int:
        fixed, shard = fixed_and_sharded(kinds)
        if offload:
            return fixed
        return fixed + (shard if scale is None else round(shard * scale))
    return on_gpu


def traced_breakdown(kinds, offload: bool) -> dict[str, int]:
    """A traced operator's breakdown, keyed as the tracker's phase snapshot is."""
    out = dict(zip(BREAKDOWN, kinds[:len(BREAKDOWN)], strict=True))
    if offload:
        out["sharded_state_in_host_memory"] = out.pop("sharded_state")
    return out


class _Op(tuple):
    """A traced operator's bytes by kind (`TRACE_KINDS`), and its name (`op`)."""

    def __new__(cls, kinds, op: str):
        self = super().__new__(cls, kinds)
        self.op = op
        return self


def _tops(stretch: list) -> list:
    """The operators of a stretch that hold some kind of bytes above the next operator (the
    last included): the others are below their successor in every kind, so never above it at
    any world size."""
    return [op for op, after in zip(stretch, stretch[1:], strict=False)
            if any(a > b for a, b in zip(op, after, strict=True))] + stretch[-1:]


def _paired(x: list, y: list) -> list[tuple] | None:
    """The operators of a stretch outside the layer stack whose length grows with the depth,
    at the shallower (`x`) and the deeper (`y`) depth, paired one to one: FSDP2's and the
    optimizer's loops over the parameters add a turn per layer (AdamW's state made parameter
    by parameter, a device check per shard), and a turn frees nothing - it keeps what it
    makes (a state) or makes nothing - so every turn is below the operator after it in every
    kind, and so is the loop. The operators above their successor (`_tops`: the first
    update's moment of every shard's temporaries, each collective's buffer before it is
    freed) are then as many at both depths, one for one
    by name, and are carried. This assumes an operator that frees nothing at the two depths
    frees nothing at any depth. None when they are not as many or their names differ (the
    phase is then run at its full depth)."""
    a, b = _tops(x), _tops(y)
    if len(a) != len(b) or any(p.op != q.op for p, q in zip(a, b, strict=True)):
        return None
    return list(zip(a, b, strict=True))


def carried_sharded(pair: tuple, key) -> list[list[int]] | None:
    """`traces.carried` of a sharded phase's (shallow, deeper, depth), loops outside the stack
    paired (`_paired`)."""
    return traces.carried(*pair, key=key, stretch=_paired)
