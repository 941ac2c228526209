"""The hooks of a LightningModule and of its callbacks as the pilot calls them: a failure names
the piece (`call_piece`), callbacks first as Lightning calls them (`fire`), and the modes they set
judged where Lightning does not undo them - a layer put in training mode inside validation
(validation normalises with each batch's statistics and moves the running ones), and a layer
left in eval mode by a hook that runs before `training_step` (the updates train without
dropout, with frozen batch-norm statistics). Lightning restores the modes it found after a
validation loop, so an `eval()` in `on_validation_end` is undone there and named nowhere."""

from __future__ import annotations

from typing import Any, Callable

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.dropout import _DropoutNd

from ...base.errors import WorkbookError
from ..task import own_code

FIX_VALIDATION = ("remove the train() call from validation: Lightning puts the module in eval "
                  "mode before validation (on_validation_model_eval) and restores the mode "
                  "after; a layer that must sample at validation (MC dropout) calls its "
                  "functional form with training=True instead")
FIX_TRAINING = ("set the mode back (pl_module.train()) or freeze only what you mean to (the "
                "batch-norm layers' requires_grad and momentum=0, not eval() on the module): "
                "Lightning calls no train() before training_step, so an eval() in a train "
                "hook lasts for every update after it")


def call_piece(piece: str, fn: Callable, *args: Any) -> Any:
    """One of the module's own methods (`own_code`); a failure names it."""
    return own_code(piece, fn, *args, whose="the module's", fix=lambda text: (
        "a LightningModule the pilot does not build reached for its trainer (one created "
        "inside the module, not a child of it): read what it needs from the module's own "
        "attributes (hparams)" if "attached to a `Trainer`" in text else f"fix {piece}"))


# the hooks run before training_step, where an eval() lasts for the updates
TRAINING_HOOKS = ("on_fit_start", "on_train_start", "on_train_epoch_start",
                  "on_train_batch_start")
VALIDATION_HOOKS = ("on_validation_batch_start", "validation_step", "on_validation_batch_end")


def fire(name: str, module: nn.Module, callbacks: list, *args: Any,
         evaluating: dict[str, bool] | None = None) -> Any:
    """Hook `name` as Lightning calls it: every callback's own (trainer, module, *args), then
    the module's (*args), whose return is returned. A training hook that leaves a layer in eval
    mode is named; a validation hook that puts one in training mode (`evaluating`: the modes
    after on_validation_model_eval) too."""
    base = lightning().Callback
    calls = [(f"callback {type(cb).__name__}.{name}", getattr(cb, name),
              (module.trainer, module, *args)) for cb in callbacks
             if getattr(type(cb), name, None) is not getattr(base, name, None)]
    if hasattr(module, name):
        calls.append((name, getattr(module, name), args))
    returned = None
    for piece, fn, given in calls:
        def call(fn=fn, piece=piece, given=given):
            return call_piece(piece, fn, *given)
        if name in TRAINING_HOOKS:
            returned = training_hook(piece, module, call)
        elif name in VALIDATION_HOOKS and evaluating is not None:
            returned = validation_hook(piece, module, evaluating, call)
        else:
            returned = call()
    return returned


def lightning() -> Any:
    """`lightning.pytorch` (or the older `pytorch_lightning`), or the error that says how to
    install it."""
    try:
        import lightning.pytorch as pl
    except ImportError:
        try:
            import pytorch_lightning as pl
        except ImportError as exc:
            raise WorkbookError("from_lightning needs Lightning, which is not installed",
                                "pip install -e '.[lightning]' (or pip install lightning)"
                                ) from exc
    return pl


def mode_dependent(module: nn.Module) -> dict[str, nn.Module]:
    """The layers whose output depends on the mode: dropout above 0, batch norm tracking
    running statistics."""
    return {name: m for name, m in module.named_modules()
            if (isinstance(m, _DropoutNd) and m.p > 0) or
            (isinstance(m, _BatchNorm) and m.track_running_stats)}


def modes_of(module: nn.Module) -> dict[str, bool]:
    return {name: m.training for name, m in mode_dependent(module).items()}


def described(module: nn.Module, names: list[str], limit: int = 3) -> str:
    layers = dict(module.named_modules())
    said = [f"{type(layers[n]).__name__} {n!r}" for n in names[:limit]]
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(said) + more


def switched(module: nn.Module, before: dict[str, bool], to: bool) -> list[str]:
    """The mode-dependent layers that were not in mode `to` before and are now."""
    return [n for n, mode in modes_of(module).items() if mode == to and before.get(n) != to]


def validation_hook(piece: str, module: nn.Module, evaluating: dict[str, bool],
                    call: Callable[[], Any]) -> Any:
    """One validation hook (`validation_step`, a batch hook); a layer it put in training mode
    is named, whether the hook then failed (batch norm on one row) or returned."""
    try:
        returned = call()
    except WorkbookError as exc:
        turned = switched(module, evaluating, True)
        if not turned:
            raise
        raise _in_training(piece, module, turned, f"; it then failed: {exc.problem}") from exc
    turned = switched(module, evaluating, True)
    if turned:
        raise _in_training(piece, module, turned, "")
    return returned


def _in_training(piece: str, module: nn.Module, turned: list[str], then: str) -> WorkbookError:
    norm = any(isinstance(dict(module.named_modules())[n], _BatchNorm) for n in turned)
    effect = ("it normalises each validation batch with that batch's own statistics and moves "
              "the running statistics the campaign evaluates and saves with (a batch of one "
              "row fails: 'Expected more than 1 value per channel when training')" if norm
              else "dropout is on while it evaluates: the metrics are noisy and too low")
    return WorkbookError(f"{piece} put {described(module, turned)} in training mode "
                         f"(model.train() inside {piece}, or a call of it): {effect}{then}",
                         FIX_VALIDATION)


def training_hook(piece: str, module: nn.Module, call: Callable[[], Any]) -> Any:
    """A hook Lightning runs before `training_step` (the module's or a callback's): a layer
    it put in eval mode stays so for the updates (Lightning sets no mode there) - named."""
    before = modes_of(module)
    returned = call()
    turned = switched(module, before, False)
    if turned:
        raise WorkbookError(f"{piece} put {described(module, turned)} in eval mode, where "
                            "training_step then runs: the updates train without dropout and "
                            "with frozen batch-norm statistics, and validation (which restores "
                            "the mode it found) does not undo it", FIX_TRAINING)
    return returned
