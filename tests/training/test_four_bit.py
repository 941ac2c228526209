"""A 4-bit (QLoRA) base sized from its storage format: the frozen linear layers hold two weights
a byte plus their quantisation constants, dequantise to the compute dtype for each matmul, and
the adapters and the head stay as they are; the twin check takes a 4-bit layer for the linear
layer it stores."""

import dataclasses

import pytest
import torch

from workbook.training import campaign, four_bit
from workbook.training.loop import UpdateShape
from workbook.training.predict import Plan, predict

pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")


def _config(vocab=64):
    return transformers.LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=512,
                                    num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, max_position_embeddings=64)


def _lora():
    from peft import LoraConfig

    return LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM")


def test_storage_is_half_a_byte_a_weight_plus_its_constants():
    assert four_bit.storage_bytes(64 * 256) == 64 * 128 + 256 + 4  # double-quantised
    assert four_bit.storage_bytes(64 * 256, double_quant=False) == 64 * 128 + 4 * 256
    assert 0.515 < four_bit.storage_bytes(8192 * 8192) / (8192 * 8192) < 0.517


def test_the_frozen_base_is_stored_in_four_bits_and_the_adapters_are_not():
    model = campaign.ConfigModel(transformers.LlamaForCausalLM, _config(), _lora(),
                                 dtype=torch.bfloat16, four_bit=True)()
    quantised = [n for n, m in model.named_modules() if isinstance(m, four_bit.FourBitLinear)]
    assert len(quantised) == 14 and all(n.endswith("base_layer") for n in quantised)
    assert type(model.base_model.model.lm_head) is torch.nn.Linear  # kept, as transformers does
    assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if "lora_" in n)
    plain = campaign.ConfigModel(transformers.LlamaForCausalLM, _config(), _lora(),
                                 dtype=torch.bfloat16)()
    assert campaign.parameter_count(model) == campaign.parameter_count(plain)
    assert campaign.module_types(model) == campaign.module_types(plain)  # the twin check


def test_a_four_bit_campaign_is_sized_from_its_storage(gen_task, gen_items):
    base = {"build_model": campaign.ConfigModel(transformers.LlamaForCausalLM, _config(300),
                                                _lora(), dtype=torch.bfloat16)}
    sized = {}
    for name, quantise in (("bf16", False), ("nf4", True)):
        model = campaign.ConfigModel(transformers.LlamaForCausalLM, _config(300), _lora(),
                                     dtype=torch.bfloat16, four_bit=quantise)
        task = dataclasses.replace(gen_task, **base, campaign_model=model, label_shift=0)
        sized[name] = predict(task, gen_items["train"][:8], gen_items["validation"][:4],
                              Plan(UpdateShape(2, 1, "bf16"), 32),
                              campaign=True).set_index("phase")
    built = campaign.ConfigModel(transformers.LlamaForCausalLM, _config(300), _lora(),
                                 dtype=torch.bfloat16, four_bit=True)()
    linear = [m for m in built.modules() if isinstance(m, four_bit.FourBitLinear)]
    stored = sum(m.packed.numel() + m.absmax.numel() for m in linear)
    full = sum(2 * m.in_features * m.out_features for m in linear)  # the same layers in bf16
    first = {k: v.loc["update (first)"] for k, v in sized.items()}
    held = {k: v.parameter_bytes + v.buffer_bytes for k, v in first.items()}
    assert held["bf16"] - held["nf4"] == pytest.approx(full - stored, abs=64)
    # gradients and optimizer state are the adapters' alone in both
    assert first["bf16"].gradient_bytes == first["nf4"].gradient_bytes
    assert sized["nf4"].predicted_peak_bytes.notna().all()
