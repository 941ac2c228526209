"""Prompts a policy completes, scored by reward functions (online RL: GRPO). An example is a
prompt; its one target stands for the group of completions sampled for it. The model's output
is, per prompt and completion, [loss numerator, reward, weight]; the loss shown is minus the
mean reward (`adapters/grpo.py`), so a policy that learns has a falling loss and a rising
reward. There is no fixed answer to reproduce: 02 asks the reward to rise."""

from __future__ import annotations

import math

from .base import Kind

PROMPTS = 8  # 01 samples each reward's completions on this many training prompts
REWARD = 1  # the reward's place in the output's last dim (adapters/grpo.py: LOSS, REWARD, WEIGHT)


class Policy(Kind):
    name = "policy"
    sampled = True
    target_words = ("prompts, each with its group of sampled completions scored by the reward "
                    "functions (the loss is minus the mean reward)")

    def leading_dims(self, labels, batch_size):
        return (batch_size,)

    def logits_fit(self, t, lead):
        return t.dim() == 3 and tuple(t.shape[:1]) == tuple(lead)

    def predicted(self, outputs, labels):
        return labels  # no answer to predict: the completions are scored, not matched

    def names_of(self, task, ids):
        return ["reward"]

    def raw_names(self, task, example):
        return ["reward"]

    def class_shares(self, task, raw):
        return None  # one target per prompt, by construction

    def initial_loss_rule(self, num_outputs):
        return "not judged: minus the policy's own mean reward"

    def expected_initial_loss(self, num_outputs, labels=None):
        return math.nan

    def reproduction(self, task, model, example, item, batch):
        rewards = task.forward(model, batch)[0, :, REWARD]
        return {"mean_reward": round(float(rewards.nanmean()), 4),
                "reward_spread": round(float(rewards.std()), 4) if rewards.numel() > 1 else 0.0}

    def model_audits(self, task, model, items):
        """The policy's own completions on a few training prompts, scored by the reward
        functions and judged (`model.audit`: lengths, None/NaN, groups of equal rewards,
        completions cut at max_completion_length)."""
        if not items or not hasattr(model, "audit"):
            return []
        batch = task.collate([it.tensors for it in items[:PROMPTS]])
        return model.audit(*(batch[k] for k in task.model_inputs), ids=[it.id for it in items])
