"""from_trainer on GRPO written as the TRL docs write it (examples/trl_grpo.py: GRPOTrainer on the
tiny pretrained Llama, conversational prompts, two reward functions with reward_weights): a
prompt is one example of the "policy" kind, the model the policy whose forward samples, scores
and takes TRL's loss; the clean setup raises nothing in 01 and learns its reward in 02, each
planted bug is named by its cause in 01 (or relayed from TRL before any notebook)."""

import pytest
import torch

from workbook.base.errors import WorkbookError
from workbook.contract.adapters.grpo import GRPOPolicy, policy_loss
from workbook.contract.data import collate_items, encode_examples, prepare
from workbook.notebooks.inspection import inspect_task
from workbook.notebooks.overfit import overfit

pytest.importorskip("trl")

PROMPTS = 30  # instructions of ten conversations: split 8 / 2 by conversation


def _task(**planted):
    from examples.trl_grpo import make_task

    return make_task(PROMPTS, **planted)


@pytest.fixture(scope="module")
def clean():
    return _task()


def _flags(task) -> dict[str, str]:
    return {f.check: f.message for f in inspect_task(task, probe_size=4, workers=0).flags}


def test_a_prompt_is_one_example_its_group_sampled_by_the_forward(clean):
    data = prepare(clean, limits={"train": 4, "validation": 2})
    items = encode_examples(clean, data.raw["train"])
    batch = collate_items(clean, items[:2]).tensors
    assert clean.decode_input(batch["input_ids"][0].tolist()).endswith("<assistant>")
    model = clean.build_model().train()
    assert isinstance(model, GRPOPolicy)
    out = clean.forward(model, batch)
    assert out.shape == (2, 4, 3)  # prompts x num_generations x (loss, reward, weight)
    summed, count = policy_loss(out, batch)
    summed.backward()
    assert count > 0 and any(p.grad is not None and p.grad.abs().sum() > 0
                             for p in model.parameters())
    assert model.draws[batch["row"]].tolist() == [1, 1]  # the next draw samples anew
    said = model.phases_said()  # 03 shows the phases of the forward apart
    assert "generation" in said and "tokens/s" in said and "policy log-probs" in said


def test_an_update_samples_the_same_however_it_is_split(clean):
    """Each prompt's completions come from its own seeded stream: two micro-batches of one
    prompt give the gradient of one micro-batch of two (04's accounting rests on it)."""
    items = encode_examples(clean, prepare(clean, limits={"train": 2}).raw["train"])
    grads = []
    for parts in ([items], [items[:1], items[1:]]):
        model = clean.build_model().train()
        total = 0
        for part in parts:
            batch = collate_items(clean, part).tensors
            summed, count = policy_loss(clean.forward(model, batch), batch)
            summed.backward()
            total += float(count)
        grads.append(torch.cat([p.grad.reshape(-1) / total for p in model.parameters()
                                if p.grad is not None]))
    assert torch.allclose(grads[0], grads[1], atol=1e-6)


def _trl_advantages(rewards: torch.Tensor, g: int, scale: str) -> torch.Tensor:
    """TRL's own advantages of a generation batch (trl/trainer/grpo_trainer.py,
    `_generate_and_score_completions`, multi_objective_aggregation="sum_then_normalize",
    trl 1.16.0), line by line."""
    from trl.trainer.utils import nanstd

    mean_grouped_rewards = torch.nanmean(rewards.view(-1, g), dim=1).repeat_interleave(g, dim=0)
    if scale in ["group", "none"]:
        std_rewards = nanstd(rewards.view(-1, g), dim=1).repeat_interleave(g, dim=0)
    else:
        std_rewards = nanstd(rewards).expand_as(rewards)
    advantages = rewards - mean_grouped_rewards
    if scale != "none":
        advantages = advantages / (std_rewards + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_the_advantages_are_trls_own_for_a_group_with_one_reward_and_unscorable_completions(
        scale):
    """A group with one scored completion (TRL's nanstd is NaN there, not 0), completions no
    reward function scored (NaN), and ordinary groups: the pilot's advantages are TRL's."""
    from workbook.contract.adapters.grpo import Rewards

    nan = float("nan")
    rewards = torch.tensor([1.0, nan, nan, nan,  # one scored: no advantage
                            0.2, 0.7, nan, 0.9,  # one unscorable
                            0.1, 0.4, 0.3, 0.8,  # ordinary
                            nan, nan, nan, nan])  # none scored
    mine = Rewards.__new__(Rewards)
    mine.scale = scale
    got = mine.advantages(rewards, 4)
    assert not got.isnan().any()
    assert torch.allclose(got, _trl_advantages(rewards, 4, scale), rtol=0, atol=1e-6)
    # 01's groups with no advantage: the equal and the under-scored, as before
    assert Rewards.flat(rewards, 4).tolist() == [True, False, False, True]
    assert Rewards.flat(torch.tensor([0.5] * 4 + [0.1, 0.2, 0.1, 0.2]), 4).tolist() == \
        [True, False]


@pytest.mark.twin
def test_the_clean_setup_raises_nothing_in_01(clean):
    assert _flags(clean) == {}


def test_the_reward_rises_in_02(clean):
    result = overfit(clean, examples=4, updates=40)
    assert result.verdict == "pass", result.checks
    assert result.figures["final_reward"] > result.figures["initial_reward"]


@pytest.mark.planted
def test_a_reward_list_of_the_wrong_length_is_named_with_its_function():
    flags = _flags(_task(wrong_length=True))
    message = " ".join(flags.values())
    assert "'<lambda>' returned 4 rewards for 16 completions" in message


@pytest.mark.planted
def test_rewards_equal_within_every_group_are_named():
    flags = _flags(_task(constant_reward=True))
    assert "frac_reward_zero_std 1.00" in flags["groups with equal rewards"]
    assert "give every completion of a prompt the same value" in \
        flags["groups with equal rewards"]


@pytest.mark.planted
def test_none_rewards_are_named_with_their_function():
    flags = _flags(_task(none_reward=True))
    assert "'<lambda>' returned None or NaN" in flags["reward None or NaN"]


@pytest.mark.planted
def test_a_reward_normalised_by_its_batch_is_named():
    flags = _flags(_task(batch_relative=True))
    assert "'<lambda>' scores" in flags["reward depends on its batch"]
    assert set(flags) == {"reward depends on its batch"}  # not taken for a padding bug


@pytest.mark.planted
def test_completions_cut_at_max_completion_length_are_named():
    flags = _flags(_task(short_completions=True))
    assert "max_completion_length=1 without an end token" in \
        flags["completions cut at max_completion_length"]


@pytest.mark.planted
def test_a_generation_batch_num_generations_does_not_divide_is_relayed_from_trl():
    with pytest.raises(WorkbookError) as err:
        _task(odd_generations=True)
    assert "must be divisible by num_generations" in err.value.problem
    assert "GRPOConfig" in str(err.value) or "fix the setup" in err.value.fix


def test_a_loss_the_pilot_does_not_compute_is_refused():
    from examples.trl_grpo import make_trainer_factory
    from workbook.contract.adapters import from_trainer

    make = make_trainer_factory(PROMPTS)

    def sapo():
        trainer = make()
        trainer.loss_type = "sapo"
        return trainer
    with pytest.raises(WorkbookError, match="loss_type='sapo'"):
        from_trainer(sapo, name="sapo")


@pytest.mark.slow
def test_an_8b_campaign_is_sized_with_its_reference():
    """examples/llama_grpo_campaign.py on fake tensors: the full fine-tune holds its frozen
    bf16 reference beside the policy (weights only), LoRA holds the base once."""
    from examples.llama_grpo_campaign import make_task
    from workbook.training.loop import UpdateShape
    from workbook.training.predict import Plan, predict

    weights = {}
    for lora in (True, False):
        task = make_task(lora=lora)
        items = encode_examples(task, prepare(task, limits={"train": 4}).raw["train"])
        sized = predict(task, items, items[:2], Plan(UpdateShape(2, 1), 0), campaign=True)
        weights[lora] = sized.set_index("phase").loc["forward + loss", "parameter_bytes"]
    assert 15e9 < weights[True] < 17e9  # 8 B in bf16, the adapters beside
    assert 31e9 < weights[False] < 33e9  # the policy and its reference


@pytest.mark.slow
def test_the_clean_grpo_example_passes_the_nine_notebooks(tmp_path):
    from workbook.commands.pilot import run_pilot

    _, index = run_pilot("examples.trl_grpo:task", out=str(tmp_path / "run"), smoke=True,
                         progress=False)
    assert (index.verdict == "pass").all(), index[["notebook", "verdict"]]


def test_a_trainer_not_mapped_yet_is_said_so_with_its_own_fix():
    """The refusal names what is mapped and gives a fix the user has not already done; through
    load_task its fix stands (no `\\n` printed literally)."""
    import trl

    from workbook.contract.adapters import from_trainer

    class KTOTrainer(trl.KTOTrainer):  # a TRL trainer the pilot does not map, as a user's
        def __init__(self):
            pass
    with pytest.raises(WorkbookError) as err:
        from_trainer(KTOTrainer, name="kto")
    assert "KTOTrainer: the pilot maps the transformers Trainer" in err.value.problem
    assert "GRPOTrainer" in err.value.problem and "before" not in err.value.fix
