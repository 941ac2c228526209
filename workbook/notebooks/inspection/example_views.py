"""Notebook 01's views of what the loss receives: a collated batch per position or example, its
tokens coloured, and the example browser."""

from __future__ import annotations

import html
import warnings

import pandas as pd
import torch

from ...base.progress import headless
from ...contract.data import Item, collate_items
from ...contract.targets import IGNORE_INDEX, contributes
from ...contract.task import Task
from .coverage import target_prompt


def batch_view(task: Task, items: list[Item]) -> pd.DataFrame:
    """One row per position (generation) or per example (classification) of a collated batch."""
    batch = collate_items(task, items).tensors
    labels, ids = batch["labels"], task.main_input(batch)
    mask = batch.get("attention_mask", torch.ones(ids.shape[:2], dtype=torch.long))
    if task.target_kind.float_targets:  # float targets per example
        return pd.DataFrame([{
            "example": items[b].id, "input": task.show_input(ids[b]),
            "target": task.decode(labels[b].reshape(-1).tolist()),
            "contributes": int(contributes(labels[b]).sum()),
        } for b in range(len(items))])
    if labels.dim() == 1:  # one label per example
        return pd.DataFrame([{
            "example": items[b].id, "input": task.show_input(ids[b][mask[b].bool()]),
            "length": int(mask[b].sum()), "label_id": int(labels[b]),
            "class": task.decode([int(labels[b])]) if int(labels[b]) != IGNORE_INDEX else "",
            "contributes": int(labels[b]) != IGNORE_INDEX,
        } for b in range(len(items))])
    prompt = target_prompt(task, batch, items)
    targets = task.targets(labels)  # what position t is trained to predict
    rows = []
    for b in range(len(items)):
        for t in range(ids.shape[1]):
            label = int(targets[b, t])
            rows.append({
                "example": items[b].id, "position": t, "input_id": int(ids[b, t]),
                "input": (task.decode_input or task.decode)([int(ids[b, t])]), "label_id": label,
                "target": task.decode([label]) if label != IGNORE_INDEX else "",
                "attention_mask": int(mask[b, t]), "padding": not bool(mask[b, t]),
                "prompt": bool(prompt[b, t]),
                "contributes": label != IGNORE_INDEX,
            })
    return pd.DataFrame(rows)


def render_tokens(view: pd.DataFrame) -> str:
    """HTML of a per-position view: green = contributes to the loss, grey = prompt, struck = pad.

    A red box marks a position that contributes although it is padding or an excluded prompt.
    """
    lines = []
    for example, rows in view.groupby("example", sort=False):
        spans = []
        for r in rows.itertuples():
            style = ["padding:1px 2px", "margin:1px", "font-family:monospace"]
            if r.contributes:
                style.append("background:#c8f0c8")
            elif r.prompt:
                style.append("background:#e6e6e6")
            if r.padding:
                style.append("text-decoration:line-through;color:#999")
            if r.contributes and (r.padding or r.prompt):
                style.append("outline:2px solid #d00")
            title = f"pos {r.position}: in {r.input_id} -> label {r.label_id}"
            spans.append(f'<span style="{";".join(style)}" title="{title}">'
                         f"{html.escape(r.target or r.input)}</span>")
        lines.append(f"<div><b>{html.escape(str(example))}</b> {''.join(spans)}</div>")
    legend = ("<div style='font-size:small'>Each cell is one position. Green: the target the "
              "loss trains on at that position (counted). Grey: a prompt position, not "
              "counted - the cell shows its input token. Struck through: padding, not "
              "counted. Red box: counted although it is padding or prompt (a bug). Hover "
              "for the ids.</div>")
    return legend + "".join(lines)


def example_display(task: Task, items: list[Item]):
    """What the loss receives for these examples: coloured tokens (generation) or a table."""
    from IPython.display import HTML

    view = batch_view(task, items)
    return HTML(render_tokens(view)) if "position" in view else view


def browser(task: Task, items: dict[str, list[Item]] | list[Item],
            raw: dict[str, list[dict]] | None = None) -> None:
    """`browser_view` displayed (the cell shows it whether or not it ends in `;`); a headless
    run shows the static view of the first example instead and creates no widget."""
    from IPython.display import display

    view = browser_view(task, items, raw)
    if view is not None:
        display(view)


def browser_view(task: Task, items: dict[str, list[Item]] | list[Item],
                 raw: dict[str, list[dict]] | None = None):
    """Browse examples one at a time, as `example_display` shows them: a split selector, a slider
    across the split (counting from 1, as the status line does) and a search by example id or
    group (exact first, else the first that contains the text, case-insensitive; the button
    searches again), as a widget. A headless run (no frontend) displays the static view of the
    first example instead, creates no widget and returns None."""
    from IPython.display import display

    by_split = {k: v for k, v in (items if isinstance(items, dict) else
                                   {"train": items}).items() if v}
    if headless():
        display(example_display(task, next(iter(by_split.values()))[:1]))
        return None
    import ipywidgets as widgets

    groups = {name: [str(ex[task.group_key]) for ex in raw[name]] for name in by_split} \
        if raw else {}
    split = widgets.Dropdown(options=list(by_split), description="split")
    index = widgets.IntSlider(1, 1, len(by_split[split.value]), description="example",
                              continuous_update=False, layout=widgets.Layout(width="95%"))
    query = widgets.Text(placeholder="example id or group", description="find",
                         continuous_update=False)
    again = widgets.Button(description="find", tooltip="search (again) for the text")
    status, out = widgets.HTML(), widgets.Output()

    def show(*_, note: str = ""):
        it = by_split[split.value][index.value - 1]
        group = groups[split.value][index.value - 1] if groups else "?"
        status.value = (f"{split.value} {index.value} of {len(by_split[split.value])}: "
                        f"id {html.escape(str(it.id))}, group {html.escape(group)}"
                        + (f" ({html.escape(note)})" if note else ""))
        out.clear_output(wait=True)
        with out:
            display(example_display(task, [it]))

    def change_split(_):
        index.max, index.value = len(by_split[split.value]), 1
        show()

    def matches(wanted: str) -> list[tuple[str, int]]:
        order = [split.value] + [n for n in by_split if n != split.value]
        keys = [(name, i, (str(it.id), groups[name][i] if groups else ""))
                for name in order for i, it in enumerate(by_split[name])]
        exact = [(n, i) for n, i, k in keys if wanted in k]
        low = wanted.lower()
        return exact or [(n, i) for n, i, k in keys if any(low in v.lower() for v in k)]

    def find(*_):
        wanted = query.value.strip()
        if not wanted:
            return
        found = matches(wanted)
        if not found:
            status.value = f"no example whose id or group contains {html.escape(wanted)!r}"
            return
        name, i = found[0]
        with index.hold_trait_notifications():
            if split.value != name:
                split.unobserve(change_split, "value")
                split.value, index.max = name, len(by_split[name])
                split.observe(change_split, "value")
            index.unobserve(show, "value")
            index.value = i + 1
            index.observe(show, "value")
        show(note=f"first of {len(found)} matching {wanted!r}" if len(found) > 1 else "")

    split.observe(change_split, "value")
    index.observe(show, "value")
    query.observe(find, "value")
    with warnings.catch_warnings():  # Enter again on the same text changes no value: only the
        warnings.simplefilter("ignore", DeprecationWarning)  # submit event says it (ipywidgets 8
        query.on_submit(find)  # keeps sending it, though it marks on_submit deprecated)
    again.on_click(find)
    show()
    return widgets.VBox([widgets.HBox([split, query, again]), index, status, out])
