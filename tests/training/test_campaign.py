"""The campaign model and its pilot twin: the twin derived from a config, a twin of another kind
refused, the campaign model sized on fake tensors only (never allocated), and a task without a
campaign model sized as before."""

import dataclasses
from functools import partial

import pandas as pd
import pytest
import torch

import workbook as wb
from workbook.base.errors import WorkbookError
from workbook.samples.generation import TinyDecoder
from workbook.samples.tokenizer import VOCAB_SIZE
from workbook.training import campaign
from workbook.training.loop import UpdateShape
from workbook.training.memory import _rss_peak, _rss_reset
from workbook.training.predict import Plan, predict

transformers = pytest.importorskip("transformers")


def test_the_twin_of_a_llama_config_keeps_the_architecture_and_shrinks_depth_and_width():
    config = transformers.LlamaConfig(hidden_size=4096, intermediate_size=11008,
                                      num_hidden_layers=32, num_attention_heads=32,
                                      num_key_value_heads=8, vocab_size=32000,
                                      max_position_embeddings=4096)
    twin = campaign.twin_config(config, layers=2, width=128, heads=4)
    assert (twin.num_hidden_layers, twin.hidden_size, twin.num_attention_heads) == (2, 128, 4)
    assert twin.num_key_value_heads == 1  # the grouped-query ratio 32:8 kept as 4:1
    assert twin.intermediate_size == 11008 * 128 // 4096  # the feed-forward ratio kept
    assert (twin.vocab_size, twin.max_position_embeddings) == (32000, 4096)
    assert config.num_hidden_layers == 32  # the campaign config is untouched
    models = campaign.from_config(transformers.LlamaForCausalLM, config)
    task = dataclasses.replace(wb.load_task("workbook.samples.generation:task"), **models)
    campaign.check_twin(task)  # same class, same module types
    counted = campaign.models(task)
    assert counted.sized_parameters > 5e9 > 2e7 > counted.trained_parameters


def test_the_twin_of_a_gpt2_config_goes_through_its_attribute_names():
    config = transformers.GPT2Config(n_layer=24, n_embd=1024, n_head=16, vocab_size=500)
    twin = campaign.twin_config(config, layers=2, width=64)
    assert (twin.n_layer, twin.n_embd, twin.n_head) == (2, 64, 4)


def test_a_config_without_depth_or_width_is_refused_with_the_fix():
    with pytest.raises(WorkbookError, match="names no depth") as err:
        campaign.twin_config(object())
    assert "build_model" in err.value.fix


def test_a_twin_of_another_kind_of_model_is_refused_naming_the_difference():
    sample = wb.load_task("workbook.samples.generation:task")
    other = dataclasses.replace(sample, campaign_model=lambda: torch.nn.Sequential(
        torch.nn.Embedding(VOCAB_SIZE, 8), torch.nn.Linear(8, VOCAB_SIZE)))
    with pytest.raises(WorkbookError, match="Sequential.*TinyDecoder|only the campaign"):
        campaign.check_twin(other)
    train = wb.prepare(sample).train[:8]
    with pytest.raises(WorkbookError, match="not the campaign model's kind"):
        predict(other, train, train, Plan(UpdateShape(1, 1), 16), campaign=True)


def test_a_campaign_model_of_gigabytes_is_sized_without_being_allocated(gen_task, gen_items):
    # a 1.1 B-parameter decoder (4.3 GiB of fp32 weights, 17 GiB with its step) beside the
    # sample's small model as its twin: sizing it must not grow the resident memory
    big = partial(TinyDecoder, VOCAB_SIZE, 4096, 5, 32, 4096, 0.0)
    task = dataclasses.replace(gen_task, campaign_model=big)
    assert campaign.models(task).sized_parameters > 1e9
    train, val = gen_items["train"][:40], gen_items["validation"][:10]
    plan = Plan(UpdateShape(2, 1), 256)
    twin = predict(task, train, val, plan)  # calibration on the twin, imports: before the reset
    if not _rss_reset():
        pytest.skip("no /proc/self/clear_refs here")
    before = _rss_peak()
    sized = predict(task, train, val, plan, campaign=True)
    grown = _rss_peak() - before
    assert grown < 512 * 2**20, grown
    assert set(sized.model) == {"campaign model"}
    assert sized.predicted_peak_bytes.max() > 4 * 4 * 1e9  # weights, grads, two Adam states
    assert set(twin.model) == {"pilot twin"}
    assert (twin.predicted_peak_bytes < sized.predicted_peak_bytes / 100).all()


def test_a_task_without_campaign_model_is_sized_as_before(gen_task, gen_items):
    train, val = gen_items["train"][:40], gen_items["validation"][:10]
    plan = Plan(UpdateShape(2, 1), 64)
    plain, asked = predict(gen_task, train, val, plan), predict(gen_task, train, val, plan,
                                                                 campaign=True)
    assert plain.predicted_peak_bytes.tolist() == asked.predicted_peak_bytes.tolist()
    assert set(asked.model) == {"the task's model"}


def test_figures_that_add_up_per_layer_are_extrapolated_along_the_depth_and_others_not():
    deep = campaign.Deep(lambda layers: torch.nn.Linear(layers, 1), layers=40)
    task = dataclasses.replace(wb.load_task("workbook.samples.generation:task"),
                               campaign_model=deep)
    calls = []

    def linear(t):
        n = t.campaign_model.build.layers
        calls.append(n)
        return {"flops": 100 + 7 * n}

    figures, how = campaign.by_depth(task, linear)
    assert figures == {"flops": 100 + 7 * 40} and calls == [2, 3, 4] and "extrapolated" in how
    calls.clear()

    def bent(t):
        n = t.campaign_model.build.layers
        calls.append(n)
        return {"flops": n * n}

    figures, how = campaign.by_depth(task, bent)
    assert figures == {"flops": 1600} and calls == [2, 3, 4, 40] and "full depth" in how
    with pytest.raises(WorkbookError, match="positive integer"):
        campaign.Deep(lambda layers: None, layers=0)


def _deep_decoder(layers: int, width: int = 64) -> torch.nn.Module:
    return TinyDecoder(VOCAB_SIZE, width, layers, 4, 256, 0.0)


@pytest.mark.parametrize("precision, checkpointing", [
    ("fp32", False), ("bf16", True)])
def test_a_deep_campaign_model_is_sized_from_two_shallow_traces_to_the_byte(
        gen_task, gen_items, monkeypatch, precision, checkpointing):
    deep = campaign.Deep(_deep_decoder, layers=7)
    task = dataclasses.replace(gen_task, campaign_model=deep)
    train, val = gen_items["train"][:20], gen_items["validation"][:5]
    plan = Plan(UpdateShape(2, 2, precision, checkpointing), 64)
    traced = predict(task, train, val, plan, campaign=True)
    assert "carried from fake runs at 3 and 4 layers to 7" in traced.attrs["sized"]
    # the same task, its depth not carried: run at 7 (its twin's calibration measured once)
    monkeypatch.setattr(campaign, "depth_of", lambda task: None)
    full = predict(task, train, val, plan, campaign=True)
    assert full.attrs["sized"] == "run at its full depth"
    assert traced.predicted_peak_bytes.tolist() == full.predicted_peak_bytes.tolist()
    assert traced.filter(like="_bytes").equals(full.filter(like="_bytes"))


def test_a_stack_that_does_not_line_up_layer_for_layer_is_run_at_its_full_depth(gen_task,
                                                                               gen_items):
    def uneven(layers: int) -> torch.nn.Module:
        model = _deep_decoder(layers)
        model.blocks.append(torch.nn.Identity())  # the stack is no longer one type
        return model

    task = dataclasses.replace(gen_task, campaign_model=campaign.Deep(uneven, layers=5),
                               build_model=partial(uneven, 2))
    train, val = gen_items["train"][:20], gen_items["validation"][:5]
    sized = predict(task, train, val, Plan(UpdateShape(1, 1), 64), campaign=True)
    assert sized.attrs["sized"] == ("run at its full depth (the shallow runs did not line up "
                                    "layer for layer)")


def test_a_tiny_models_parameters_are_counted_not_rounded_to_zero_millions():
    from workbook.training.campaign import Models

    tiny = Models(False, "MLP", 49, "MLP", 49).lines()
    assert tiny == ["model: 49 parameters, trained and sized here"]
    assert "8.59 M parameters" in Models(False, "x", 8_590_000, "x", 8_590_000).lines()[0]


def _llama(layers: int = 2, width: int = 64, vocab: int = 300, **more):
    return transformers.LlamaConfig(vocab_size=vocab, hidden_size=width,
                                    intermediate_size=2 * width, num_hidden_layers=layers,
                                    num_attention_heads=4, num_key_value_heads=2,
                                    max_position_embeddings=64, **more)


def _lora():
    from peft import LoraConfig

    return LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM")


CONVERSIONS = {"to": lambda m: m.to(torch.bfloat16), "half": lambda m: m.half()}


def _as_users_write_it(config, convert: str, lora: bool):
    """A campaign factory as users write one: the model built, converted, maybe wrapped."""
    def build():
        model = CONVERSIONS[convert](transformers.LlamaForCausalLM(config))
        if not lora:
            return model
        from peft import get_peft_model

        return get_peft_model(model, _lora())
    return build


def _held_bytes(model) -> int:
    """Bytes the parameters hold (shared tensors once)."""
    return sum(p.numel() * p.element_size()
               for p in {id(p): p for p in model.parameters()}.values())


# `.to(dtype)` (which `_MetaStays` sees) with get_peft_model around it, and `.half()` (which
# it lets through, as `.bfloat16()`: the same path, so not a case of its own); the workbook
# never branches on how a model was converted otherwise (the factory runs on the meta device)
@pytest.mark.parametrize("convert, lora", [("to", True), ("half", False)])
def test_a_campaign_model_converted_as_users_write_it_is_sized_in_its_dtype(
        gen_task, gen_items, convert, lora):
    """`LlamaForCausalLM(cfg).to(torch.bfloat16)` (or `.half()`), maybe wrapped
    by get_peft_model: PyTorch refuses to convert fake parameters ("_apply(): Couldn't swap
    Embedding.weight"), so the factory runs on the meta device outside the fake mode. Its base
    holds 2 bytes a parameter, as the same base through ConfigModel(dtype=bf16)."""
    if lora:
        pytest.importorskip("peft")
    adapters = _lora() if lora else None
    users = _as_users_write_it(_llama(), convert, lora)
    task = dataclasses.replace(
        gen_task, label_shift=0,
        build_model=campaign.ConfigModel(transformers.LlamaForCausalLM, _llama(), adapters),
        campaign_model=users)
    train, val, plan = gen_items["train"][:8], gen_items["validation"][:4], \
        Plan(UpdateShape(2, 1, "bf16"), 32)
    sized = predict(task, train, val, plan, campaign=True).set_index("phase")
    assert sized.predicted_peak_bytes.notna().all() and (sized.note == "").all(), sized.note
    meta = campaign.on_meta(task.campaign_model)
    base = [p for p in meta.parameters() if not p.requires_grad] if lora else \
        list(meta.parameters())
    assert {p.element_size() for p in base} == {2}  # bf16 or fp16, never fp32
    assert (sized.parameter_bytes == _held_bytes(meta)).all()
    assert sized.parameter_bytes.iloc[0] < 3 * campaign.parameter_count(meta)
    # the same base through ConfigModel(dtype=bf16): its bytes by category from the campaign's
    # fake run, which `predict` reads them from (the twin's calibration, as above, not made again)
    from workbook.training.fake_phases import campaign_phases
    from workbook.training.loop import TrainConfig
    from workbook.training.workload import sized_batches

    config_task = dataclasses.replace(task, campaign_model=campaign.ConfigModel(
        transformers.LlamaForCausalLM, _llama(), adapters, dtype=torch.bfloat16))
    rows, _ = campaign_phases(config_task, TrainConfig(plan.shape, device="cpu"),
                              *sized_batches(config_task, train, val, plan), plan.label())
    reference = pd.DataFrame(rows).set_index("phase")
    assert sized.parameter_bytes.tolist() == reference.parameter_bytes.tolist()
    assert sized.gradient_bytes.tolist() == reference.gradient_bytes.tolist()


@pytest.mark.parametrize("move", [lambda m: m.to("cuda", torch.bfloat16),
                                  lambda m: m.bfloat16().cuda(),
                                  lambda m: m.to(device="cpu", dtype=torch.bfloat16)])
def test_a_factory_that_moves_its_model_to_a_device_is_built_on_the_meta_device(move):
    """`.to("cuda", ...)`, `.cuda()`, `.to("cpu")`: a meta tensor has no data to move (and this
    machine may have no GPU); it stays on the meta device in the dtype asked for."""
    model = campaign.on_meta(lambda: move(transformers.LlamaForCausalLM(_llama())))
    assert {(p.device.type, p.dtype) for p in model.parameters()} == {("meta", torch.bfloat16)}


def test_a_campaign_factory_that_reads_values_is_refused_with_the_config_model_fix(
        gen_task, gen_items):
    def reads_a_value():
        torch.tensor([0.5]).item()  # no value on the meta device
        return transformers.LlamaForCausalLM(_llama()).to(torch.bfloat16)

    task = dataclasses.replace(
        gen_task, label_shift=0, campaign_model=reads_a_value,
        build_model=campaign.ConfigModel(transformers.LlamaForCausalLM, _llama()))
    with pytest.raises(WorkbookError, match="cannot be built on the meta device "
                       r"\(Tensor.item\(\) cannot be called on meta tensors\)") as err:
        predict(task, gen_items["train"][:8], gen_items["validation"][:4],
                Plan(UpdateShape(2, 1, "bf16"), 32), campaign=True)
    assert "wb.campaign.ConfigModel(ModelClass, config, dtype=torch.bfloat16)" in err.value.fix


@pytest.mark.slow  # 23 s; the idiom itself is tested small above and in tests/blind
def test_an_8b_lora_campaign_converted_by_to_is_sized_in_bf16(gen_task, gen_items):
    """The 8 B LoRA campaign as users write it (Llama-3-8B's shape, `.to(torch.bfloat16)`,
    get_peft_model): every phase sized, the frozen base at 2 bytes a parameter."""
    pytest.importorskip("peft")
    config = transformers.LlamaConfig(vocab_size=128256, hidden_size=4096,
                                      intermediate_size=14336, num_hidden_layers=32,
                                      num_attention_heads=32, num_key_value_heads=8,
                                      max_position_embeddings=8192, rope_theta=500000.0)
    task = dataclasses.replace(
        gen_task, label_shift=0, campaign_model=_as_users_write_it(config, "to", True),
        build_model=campaign.ConfigModel(transformers.LlamaForCausalLM,
                                         campaign.twin_config(config), _lora()))
    sized = predict(task, gen_items["train"][:8], gen_items["validation"][:4],
                    Plan(UpdateShape(1, 1, "bf16"), 32), campaign=True).set_index("phase")
    assert sized.predicted_peak_bytes.notna().all()
    meta = campaign.on_meta(task.campaign_model)
    frozen = sum(p.numel() for p in meta.parameters() if not p.requires_grad)
    assert frozen > 7.5e9 and (sized.parameter_bytes == _held_bytes(meta)).all()
    assert 2 * frozen < sized.parameter_bytes.iloc[0] < 2.01 * frozen  # bf16, not fp32
