"""Why a model's forward (or the loss on its outputs) raised, in words notebook 01 can flag:
lookups beyond an embedding table, label ids beyond the output layer, a shape mismatch."""

from __future__ import annotations

import re

import torch

from ...base.errors import WorkbookError, reason
from ...contract.data import Item
from ...contract.targets import IGNORE_INDEX
from ...contract.task import Task
from ...storage.records import Flag

SHAPE_WORDS = re.compile(r"shape|size mismatch|sizes? of tensors|mat1 and mat2|must match "
                         r"the size|expected input|dimension", re.IGNORECASE)


def model_failure(task: Task, model: torch.nn.Module, batch: dict, items: list[Item],
                  exc: Exception, data: list[Item] | None = None, outputs: int | None = None,
                  step: str = "forward") -> Flag:
    """A model forward (or the loss on its outputs: `step`) that raised, as a flag naming the
    cause 01 can find - ids beyond an embedding table, label ids beyond the output layer, a
    shape mismatch - or else the exception's text. `data`: every example, to count them."""
    data = data or items
    what = "the model's forward" if step == "forward" else "the task's loss"
    batch_of = f"a batch of {len(items)} example{'s' if len(items) != 1 else ''}"
    raised = f"{what} raised {type(exc).__name__} ({reason(exc, 160)}) on {batch_of}"
    if isinstance(exc, WorkbookError):  # it names the problem itself
        raised, causes = f"{what} failed on {batch_of}", [(exc.problem, exc.fix, [])]
    else:
        causes = (state_causes(task, model, exc) + embedding_causes(task, model, batch, data)
                  if step == "forward" else []) + label_causes(task, model, data, outputs)
        if not causes and SHAPE_WORDS.search(str(exc)):
            causes = [("a shape mismatch", "make the model's sizes match what the data gives "
                       "(the message names both shapes): input features, sequence length, the "
                       "head's input width", [])]
    if not causes:
        call = "task.forward(model, batch)" if step == "forward" else \
            "task.loss(task.forward(model, batch), batch)"
        causes = [("", f"make {what} run on every collated batch of this task (call {call} "
                   "on one batch to see the whole traceback)", [])]
    examples = list(dict.fromkeys(e for _, _, ids in causes for e in ids)) or \
        [it.id for it in items]
    found = [m for m, _, _ in causes if m]
    message = raised + (": " + "; ".join(found) if found else "")
    return Flag("model forward fails" if step == "forward" else "loss fails", message,
                len(examples), "; ".join(dict.fromkeys(f for _, f, _ in causes)), examples[:5])


MISSING = re.compile(r"missing (?:\d+ )?required positional arguments?: (.*)")


def state_causes(task: Task, model: torch.nn.Module, exc: Exception) -> list[tuple]:
    """A forward that needs an argument the batch does not give - most often the state a
    recurrent model carries between batches (`forward(input, hidden)`), which a task declares
    with `CarriedState`."""
    found = MISSING.search(str(exc)) if isinstance(exc, TypeError) else None
    if found is None or "forward()" not in str(exc):
        return []
    names = re.findall(r"'(\w+)'", found.group(1))
    if not names:
        return []
    init = next((n for n in ("init_hidden", "init_state", "initial_state", "init_memory")
                 if callable(getattr(model, n, None))), None)
    start = f"model.{init}(rows)" if init else "<the state for `rows` streams>"
    arg = "" if names[0] == "hidden" else f", argument={names[0]!r}"
    return [(f"the forward needs `{names[0]}`, which no batch key gives"
             + (f" - the state a recurrent model carries from batch to batch (the model has "
                f"{init})" if init or task.state is None else ""),
             f"declare the carried state: Task(state=workbook.CarriedState(init=lambda model, "
             f"rows: {start}{arg})) - the workbook passes it in, keeps it per stream "
             "(batch[\"stream\"]), detaches it and resets it each pass; or put "
             f"{names[0]!r} in model_inputs if the batch should give it", [])]


def embedding_causes(task: Task, model: torch.nn.Module, batch: dict,
                     data: list[Item]) -> list[tuple[str, str, list]]:
    """Lookups beyond an `nn.Embedding` table in one forward on `batch` (each table's largest
    index is read by a hook before its lookup): token ids beyond the vocabulary, positions
    beyond a position table, negative ids."""
    main = task.main_input(batch)
    seen: dict[str, tuple[int, int, int, bool]] = {}

    def watch(name: str):
        def hook(module, args):
            index = args[0] if args else None
            if isinstance(index, torch.Tensor) and not index.is_floating_point() and \
                    index.numel() and name not in seen:
                seen[name] = (int(index.min()), int(index.max()), module.num_embeddings,
                              index.shape == main.shape and bool(torch.equal(index, main)))
        return hook

    handles = [m.register_forward_pre_hook(watch(n)) for n, m in model.named_modules()
               if isinstance(m, torch.nn.Embedding)]
    try:
        with torch.no_grad():
            task.forward(model, batch)
    except Exception:
        pass  # the failure being explained
    finally:
        for h in handles:
            h.remove()
    causes = []
    for name, (low, high, rows, token) in seen.items():
        if low < 0:
            causes.append((f"the inputs hold id {low} for the model's embedding `{name}`, "
                           "which has no negative rows", "give the inputs real token ids (pad "
                           "inputs with a pad token; -100 belongs in the labels only)", []))
        elif high >= rows and token:
            tops = [(it.id, int(ids.max())) for it in data
                    if (ids := task.main_input(it.tensors)).numel()]
            beyond = [i for i, t in tops if t >= rows]
            top = max([high] + [t for _, t in tops])
            causes.append((f"the data holds token id {top} but the model's embedding `{name}` "
                           f"has {rows} rows ({len(beyond)} of {len(data)} examples hold ids "
                           "beyond it)", f"make the vocabulary size at least max id + 1 = "
                           f"{top + 1} (the rows of `{name}`), or map the ids into the table",
                           beyond))
        elif high >= rows:
            length = main.shape[-1]
            causes.append((f"the model's embedding `{name}` is looked up with index {high} but "
                           f"has {rows} rows" + (f": a sequence of {length} positions is longer "
                                                 "than this position table"
                                                 if high == length - 1 else ""),
                           f"cut the data to at most {rows} positions (max_length), or build "
                           "the model for longer inputs" if high == length - 1 else
                           f"give `{name}` at least {high + 1} rows, or keep the indices the "
                           f"model computes below {rows}", []))
    return causes


def label_causes(task: Task, model: torch.nn.Module, data: list[Item],
                 outputs: int | None) -> list[tuple[str, str, list]]:
    """Label ids beyond the model's outputs (from a forward when it ran, else its last linear
    layer), or negative ones other than -100."""
    if task.target_kind.float_targets:
        return []
    layer = None if outputs is not None else output_layer(model)
    n = outputs if outputs is not None else layer[1] if layer else None
    bad, top, low = [], None, None
    for it in data:
        real = it.tensors["labels"].reshape(-1)
        real = real[real != IGNORE_INDEX]
        if real.numel() and ((n is not None and int(real.max()) >= n) or int(real.min()) < 0):
            bad.append(it.id)
            top = max(top or 0, int(real.max()))
            low = min(low if low is not None else 0, int(real.min()))
    if not bad:
        return []
    if low is not None and low < 0:
        return [(f"the labels hold id {low}, and only -100 is ignored", "give labels ids "
                 "0..outputs-1, and -100 where nothing is learned", bad)]
    where = f"the model's {n} outputs" if layer is None else \
        f"the {n} outputs of the model's last linear layer `{layer[0]}`"
    return [(f"the labels hold id {top}, beyond {where} (ids 0..{n - 1}; {len(bad)} of "
             f"{len(data)} examples)",
             f"make the output layer at least max label id + 1 = {top + 1} wide, or fix the "
             "label map", bad)]


def output_layer(model: torch.nn.Module) -> tuple[str, int] | None:
    """The model's last `nn.Linear` (name, outputs): the output layer, when a forward cannot
    say (the forward failed)."""
    linears = [(n, m.out_features) for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear)]
    return linears[-1] if linears else None
