"""The campaign model and its pilot twin. A task may declare the model the rental will train
(`Task.campaign_model`, usually far bigger than the pilot machine); its `build_model` is then the
twin the pilot machine trains: the same code and module types, fewer layers, narrower. The
campaign model is only ever built on the meta device or on fake tensors."""

from __future__ import annotations

import copy
import dataclasses
from collections import Counter
from typing import Any, Callable

import torch
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.overrides import TorchFunctionMode

from ..base.errors import WorkbookError, reason
from ..contract.model_factory import ModelFactory
from . import four_bit

# what a Hugging Face config calls its depth, width, heads and feed-forward width (canonical
# names; a config's attribute_map turns them into its own, e.g. GPT-2's n_layer, n_embd)
_DEPTH = ("num_hidden_layers", "n_layer", "num_layers")
_WIDTH = ("hidden_size", "n_embd", "d_model")
_HEADS = ("num_attention_heads", "n_head")
_FFN = ("intermediate_size", "n_inner", "ffn_dim", "d_ff")


def declared(task) -> bool:
    """Whether the task declares a campaign model apart from the model the pilot trains."""
    return task.campaign_model is not None


def factory(task, campaign: bool = True) -> Callable[[], nn.Module]:
    """The factory of the model a figure is for: the campaign model (when declared and
    `campaign`), else the model the pilot machine trains."""
    return task.campaign_model if campaign and declared(task) else task.build_model


def which(task, campaign: bool = True) -> str:
    """The name tables give the model a figure belongs to."""
    if not declared(task):
        return "the task's model"
    return "campaign model" if campaign else "pilot twin"


_MOVES = (torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu)


class _MetaStays(TorchFunctionMode):
    """A meta tensor moved to a device (`.to("cuda", torch.bfloat16)`, `.cuda()`, `.cpu()`)
    stays on the meta device, its dtype converted: it has no data to move (PyTorch: "Cannot
    copy out of meta tensor"), and a machine without the device could not build it at all."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        moved = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if moved is None or not moved.is_meta or func not in _MOVES:
            return func(*args, **kwargs)
        if func is torch.Tensor.to:
            rest = {k: v for k, v in kwargs.items() if k != "copy"}
            dtype = torch._C._nn._parse_to(*args[1:], **rest)[1]
            return moved.to(dtype) if dtype is not None else moved
        return moved


def on_meta(build: Callable[[], nn.Module]) -> nn.Module:
    """A model built on the meta device: shapes and dtypes only, nothing allocated. Built
    outside any active fake mode: a factory's own conversion (`.to(torch.bfloat16)`, `.half()`)
    then runs on plain meta tensors, where inside the mode PyTorch must swap fake parameters and
    refuses ("_apply(): Couldn't swap Embedding.weight", pytorch/pytorch#148977); a move to a
    device keeps the meta device (`_MetaStays`)."""
    with unset_fake_temporarily(), torch.device("meta"), _MetaStays():
        return build()


def held_on_meta(build: Callable[[], nn.Module]) -> nn.Module:
    """`on_meta(build)`, built once per factory and held on it (`ModelFactory.meta`: a task's
    model and campaign model each once, whatever asks for their shapes); read it, change a
    copy (`meta_copy`)."""
    if not isinstance(build, ModelFactory):
        return on_meta(build)
    if build.meta is None:
        build.meta = on_meta(build)
    return build.meta


def meta_copy(build: Callable[[], nn.Module]) -> nn.Module:
    """A model of `build` on the meta device to change (to fill with fake tensors): a copy of
    the held one (`held_on_meta`), or one built anew where the model cannot be copied."""
    held = held_on_meta(build)
    try:
        with unset_fake_temporarily():  # a copy of plain meta tensors, as `on_meta` builds
            return copy.deepcopy(held)
    except Exception:  # a model holding what cannot be copied (a lock, a generator)
        return on_meta(build)


SWAP = "Couldn't swap"  # PyTorch's words when it converts a fake tensor in place


def unconvertible(exc: BaseException, meta: BaseException, piece: str) -> WorkbookError | None:
    """A factory that reads tensor values while it builds (so not on the meta device) and then
    converts its model (`.to(dtype)`, `.half()`): PyTorch cannot convert fake parameters, so
    such a model cannot be sized; said with the fix, else None."""
    if SWAP not in str(exc):
        return None
    return WorkbookError(
        f"the task's {piece} cannot be sized on fake tensors: it does not build on the meta "
        f"device ({reason(meta.__cause__ or meta)}), and on fake tensors PyTorch cannot "
        f"convert the model it builds ({reason(exc.__cause__ or exc)})",
        "build the model in its dtype instead of converting it afterwards: "
        "wb.campaign.ConfigModel(ModelClass, config, dtype=torch.bfloat16) (adapters="
        "LoraConfig(...) for a fine-tune), or a factory that reads no tensor values")


def parameter_count(model: nn.Module) -> int:
    """Parameters of a model (shared tensors counted once; a 4-bit layer's weights, two a
    byte, counted as weights)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values()) + sum(
        m.packed.numel() for m in model.modules() if isinstance(m, four_bit.FourBitLinear))


def _attr(config: Any, names: tuple[str, ...]) -> str | None:
    return next((n for n in names if isinstance(getattr(config, n, None), int)), None)


def twin_config(config: Any, layers: int = 2, width: int = 128, heads: int = 4) -> Any:
    """A pilot twin of a `transformers` config: the same architecture with `layers` layers,
    hidden width `width` and at most `heads` attention heads (the grouped-query ratio, the
    feed-forward ratio, the vocabulary and the positions kept). Refused with the attribute
    named when the config does not say its depth or width."""
    twin = copy.deepcopy(config)
    depth, hidden = _attr(config, _DEPTH), _attr(config, _WIDTH)
    if depth is None or hidden is None:
        what, names = ("depth", _DEPTH) if depth is None else ("width", _WIDTH)
        raise WorkbookError(
            f"cannot derive a pilot twin of {type(config).__name__}: it names no {what} "
            f"({', '.join(names)})",
            "build the twin yourself: set build_model to a factory of the same model class with "
            "a small config, and campaign_model to the full one")
    old_width = getattr(config, hidden)
    setattr(twin, depth, min(layers, getattr(config, depth)))
    setattr(twin, hidden, min(width, old_width))
    head_attr = _attr(config, _HEADS)
    if head_attr:
        old_heads = getattr(config, head_attr)
        new_heads = max(1, min(heads, old_heads))
        while getattr(twin, hidden) % new_heads:
            new_heads -= 1
        setattr(twin, head_attr, new_heads)
        kv = getattr(config, "num_key_value_heads", None)
        if isinstance(kv, int) and kv > 0:
            twin.num_key_value_heads = max(1, new_heads * kv // old_heads)
            while new_heads % twin.num_key_value_heads:
                twin.num_key_value_heads -= 1
        if isinstance(getattr(config, "head_dim", None), int):
            twin.head_dim = getattr(twin, hidden) // new_heads
    ffn = _attr(config, _FFN)
    if ffn:
        setattr(twin, ffn, max(1, getattr(config, ffn) * getattr(twin, hidden) // old_width))
    return twin


class Deep:
    """A model factory that can build the same model at any depth: `build(layers=n)`. FLOPs of
    a deep campaign model are counted at 2, 3 and 4 layers and extrapolated along the depth
    (each layer adds the same FLOPs; checked on the three depths). Memory is never
    extrapolated: peaks bend with the depth. `workbook.campaign.Deep(my_factory, layers=80)`."""

    def __init__(self, build: Callable[..., nn.Module], layers: int):
        if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
            raise WorkbookError(f"Deep(..., layers={layers!r}): the depth must be a positive "
                                "integer", "give the campaign model's number of layers")
        self.build, self.layers = build, layers

    def __call__(self) -> nn.Module:
        return self.build(layers=self.layers)

    def with_layers(self, layers: int) -> "Deep":
        return Deep(self.build, layers)


class ConfigModel(Deep):
    """A `transformers` model class and config as a factory (the config is copied per build);
    with `adapters` (a PEFT config such as `LoraConfig`) the model is wrapped as a fine-tune
    (`peft.get_peft_model`, a fresh copy of the adapters' config per build: its base frozen);
    `dtype` is the base's (bf16 for a base loaded in bf16), the adapters stay as PEFT makes
    them; `four_bit` stores the frozen base's linear layers in 4 bits as QLoRA does (sized
    from its storage format: `training/four_bit.py`)."""

    def __init__(self, model_class: Any, config: Any, adapters: Any = None,
                 dtype: torch.dtype | None = None, four_bit: bool = False):
        self.model_class, self.config = model_class, config
        self.adapters, self.dtype, self.four_bit = adapters, dtype, four_bit
        depth = _attr(config, _DEPTH)
        super().__init__(self._build, getattr(config, depth) if depth else 1)

    def _build(self, layers: int) -> nn.Module:
        config = copy.deepcopy(self.config)
        depth = _attr(config, _DEPTH)
        if depth:
            setattr(config, depth, layers)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype or previous)  # built in it: no copy to convert
        try:
            model = self.model_class(config)
        finally:
            torch.set_default_dtype(previous)
        if self.adapters is None:
            return model
        from peft import get_peft_model

        model = get_peft_model(model, copy.deepcopy(self.adapters))
        return four_bit.quantised(model) if self.four_bit else model

    def with_layers(self, layers: int) -> "ConfigModel":
        config = copy.deepcopy(self.config)
        setattr(config, _attr(config, _DEPTH), layers)
        return ConfigModel(self.model_class, config, self.adapters, self.dtype, self.four_bit)


def from_config(model_class: Any, config: Any, layers: int = 2, width: int = 128,
                heads: int = 4, adapters: Any = None,
                dtype: torch.dtype | None = None) -> dict[str, Callable[[], nn.Module]]:
    """`build_model` (the pilot twin, `twin_config`) and `campaign_model` (the full config) for
    a `transformers` model class, to pass to `workbook.Task(...)` or `dataclasses.replace`;
    `adapters` (a PEFT `LoraConfig`) makes both a fine-tune of a frozen base, `dtype` the
    base's dtype:

        wb.Task(..., **wb.campaign.from_config(LlamaForCausalLM, LlamaConfig(...)))
        wb.campaign.from_config(LlamaForCausalLM, config, adapters=LoraConfig(r=16, ...))
    """
    return {"build_model": ConfigModel(model_class, twin_config(config, layers, width, heads),
                                       adapters, dtype),
            "campaign_model": ConfigModel(model_class, config, adapters, dtype)}


DEPTHS = (2, 3, 4)  # the depths a deep campaign model is sized at
LINEAR_TOLERANCE = 0.002  # per-layer growth may differ this much (of the extrapolated value)


def depth_of(task) -> Deep | None:
    """The campaign model's factory when it can build other depths and is deeper than the
    depths it would be sized at, else None."""
    build = getattr(task.campaign_model, "build", None)  # the task's ModelFactory unwrapped
    return build if isinstance(build, Deep) and build.layers > DEPTHS[-1] else None


def by_depth(task, measure: Callable[[Any], dict[str, float]]) -> tuple[dict[str, float], str]:
    """`measure(task)` of the campaign model - a dict of figures that add up per layer (FLOPs;
    not memory peaks, which bend with the depth) - and
    how it was obtained. A deep campaign model (`depth_of`) is measured at `DEPTHS` layers and
    extrapolated linearly to its depth; when a figure does not grow by the same amount per
    layer there (within `LINEAR_TOLERANCE`), the full depth is measured instead."""
    deep = depth_of(task)
    if deep is None:
        return measure(task), "run at its full depth"
    runs = [measure(dataclasses.replace(task, campaign_model=deep.with_layers(n)))
            for n in DEPTHS]
    out, step = {}, DEPTHS[1] - DEPTHS[0]
    for key in runs[0]:
        values = [r[key] for r in runs]
        if any(v is None or v != v for v in values):  # NaN: not sized
            out[key] = float("nan")
            continue
        first, second = values[1] - values[0], values[2] - values[1]
        value = values[2] + (deep.layers - DEPTHS[2]) * second / step
        if abs(first - second) * (deep.layers - DEPTHS[0]) / step > \
                LINEAR_TOLERANCE * max(abs(value), 1.0):
            return measure(task), (f"run at its full depth ({deep.layers} layers): a figure "
                                   f"({key}) does not grow linearly with the depth")
        out[key] = value
    return out, (f"extrapolated from fake runs at {', '.join(map(str, DEPTHS))} layers to "
                 f"{deep.layers} (every figure grows by the same amount per layer)")


def module_types(model: nn.Module) -> Counter:
    """How many modules of each type a model holds (a 4-bit layer counts as the `nn.Linear` it
    stores: the campaign's base may be quantised where the twin's is not)."""
    return Counter("Linear" if isinstance(m, four_bit.FourBitLinear) else type(m).__name__
                   for m in model.modules())


def check_twin(task) -> None:
    """Refuse a twin that is not the campaign model's kind of model: another root class, or a
    module type one has and the other does not (a check of the twin says nothing of layers the
    campaign model has and the twin lacks). Both are built on the meta device."""
    if not declared(task):
        return
    try:
        campaign, twin = held_on_meta(task.campaign_model), held_on_meta(task.build_model)
    except Exception as exc:
        cause = exc.__cause__ if isinstance(exc, WorkbookError) else exc  # the factory's own
        if cause is None or isinstance(cause, WorkbookError) or "meta" not in str(cause):
            raise  # a failure of the factory itself, in its own words
        raise WorkbookError(f"the campaign model or its twin of {task.name!r} cannot be built on "
                            f"the meta device ({reason(cause)})",
                            "build them without reading tensor values (no weights loaded from "
                            "disk in the factory): wb.campaign.ConfigModel(ModelClass, config, "
                            "dtype=torch.bfloat16) for a transformers model") from exc
    problems = []
    if type(campaign) is not type(twin):
        problems.append(f"the campaign model is a {type(campaign).__name__}, the twin a "
                        f"{type(twin).__name__}")
    only_campaign = sorted(set(module_types(campaign)) - set(module_types(twin)))
    only_twin = sorted(set(module_types(twin)) - set(module_types(campaign)))
    if only_campaign:
        problems.append(f"module types only the campaign model has: {', '.join(only_campaign)}")
    if only_twin:
        problems.append(f"module types only the twin has: {', '.join(only_twin)}")
    if problems:
        raise WorkbookError(f"the pilot twin of {task.name!r} is not the campaign model's kind "
                            f"of model: {'; '.join(problems)}",
                            "build the twin from the same code with fewer layers and a smaller "
                            "width (workbook.campaign.from_config does it for a transformers "
                            "config)")


@dataclasses.dataclass
class Models:
    """Which models a run's figures belong to, for tables and the report."""

    declared: bool
    trained: str  # the model the pilot machine trains
    trained_parameters: int
    sized: str  # the model the memory prediction and the rental plan size
    sized_parameters: int
    trained_trainable: int | None = None  # parameters that train (None: all of them)
    sized_trainable: int | None = None

    def lines(self) -> list[str]:
        if not self.declared:
            return [f"model: {parameters(self.trained_parameters)}"
                    f"{_frozen(self.trained_parameters, self.trained_trainable)}, trained and "
                    "sized here"]
        return [f"pilot twin (trained here): {self.trained}, "
                f"{parameters(self.trained_parameters)}"
                f"{_frozen(self.trained_parameters, self.trained_trainable)}",
                f"campaign model (sized on fake tensors, never allocated here): {self.sized}, "
                f"{self.sized_parameters / 1e9:,.2f} B parameters"
                f"{_frozen(self.sized_parameters, self.sized_trainable)}"]


def _frozen(total: int, trainable: int | None) -> str:
    """How much of a model trains, when not all of it (a fine-tune's frozen base)."""
    if trainable is None or trainable >= total:
        return ""
    return (f" of which {parameters(trainable)} train ({trainable / total:.2%}; the frozen "
            "rest holds weights only: no gradient, no optimizer state)")


def parameters(count: int) -> str:
    """A parameter count for people: millions with two decimals, or the count itself below
    ten thousand (a tiny model is not "0.00 M")."""
    return f"{count:,} parameters" if count < 10_000 else f"{count / 1e6:,.2f} M parameters"


def models(task) -> Models:
    """The models of a task, counted on the meta device."""
    def shape(model: nn.Module) -> str:
        config = getattr(model, "config", None)
        depth = _attr(config, _DEPTH) if config is not None else None
        hidden = _attr(config, _WIDTH) if config is not None else None
        if depth and hidden:
            return (f"{type(model).__name__}, {getattr(config, depth)} layers x "
                    f"{getattr(config, hidden)} wide")
        return type(model).__name__

    twin = held_on_meta(task.build_model)
    sized = held_on_meta(task.campaign_model) if declared(task) else twin
    def trainable(model: nn.Module) -> int:
        return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values()
                   if p.requires_grad)

    return Models(declared(task), shape(twin), parameter_count(twin), shape(sized),
                  parameter_count(sized), trainable(twin), trainable(sized))
