"""GRPO as TRL's GRPOTrainer runs it, as a Task of the "policy" kind: a prompt is one example,
and the model is the policy beside its reference (`GRPOPolicy`), whose forward makes the whole
of a GRPO micro-step on its prompts - `num_generations` completions sampled per prompt (the
trainer's generation config, cut at the first end token), the user's reward functions called on
them with the dataset's other columns (weighted by `reward_weights`), the advantages normalised
within each group (`scale_rewards`), the reference's log-probs (`beta`), and the clipped
per-token policy loss of `loss_type`. Every notebook's update, memory and timing are then
GRPO's own, generation included.

The loss the workbook reads is minus the mean reward (per completion token for the token-level
losses, per completion for `loss_type="grpo"`), with the gradient of TRL's loss: the loss curves
of 02, 06 and 07 are reward curves, and the workbook's normalisation over the update's targets
is TRL's (`dapo`: the update's completion tokens; `grpo`: its completions; `dr_grpo`:
completions x max_completion_length). Each prompt's completions are drawn from a stream seeded by
the prompt and how often it was drawn (a buffer of the model, so checkpoints carry it): an
update's samples do not depend on how it is split into micro-batches or ranks."""

from __future__ import annotations

import contextlib
import math
import time
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from ...base.errors import WorkbookError, reason
from ...storage.records import Flag
from ..task import Task
from .base import BesideReference, SplitRows
from .hf_trainer import argument_fields

# what the workbook reads per completion from the forward: the loss numerator (with the
# gradient), the reward, the completion's weight in the normalisation (tokens or 1)
LOSS, REWARD, WEIGHT = range(3)
INPUTS = ("input_ids", "attention_mask", "row")
LOSSES = ("dapo", "grpo", "dr_grpo", "bnpo")  # the loss_types the pilot computes
SEED_STRIDE = 1_000_003  # a prompt's draws: seed + row * stride + draw
FLAT_SHARE = 0.5  # 01 flags when at least this share of groups have equal rewards
CUT_SHARE = 0.5  # 01 flags when at least this share of completions are cut


class Rewards:
    """The user's reward functions on one batch of completions, as TRL calls them (the prompts,
    completions and completion ids, every other column of the prompt's row, `trainer_state`),
    and the group-normalised advantages of `scale_rewards`. Shared, never copied."""

    def __init__(self, trainer: Any, rows: Callable[[int], dict]):
        self.functions = list(trainer.reward_funcs)
        self.names = list(trainer.reward_func_names)
        self.weights = trainer.reward_weights.float().cpu()
        self.state, self.rows = trainer.state, rows
        self.scale = str(trainer.scale_rewards)
        self.tokenizer = trainer.processing_class

    def __deepcopy__(self, memo: dict) -> "Rewards":
        return self  # functions and datasets: the same for every copy of the model

    def completions(self, prompts: list, ids: list[list[int]]) -> list:
        """The completions as TRL hands them to the reward functions: text, or one assistant
        message for conversational prompts."""
        texts = self.tokenizer.batch_decode(ids, skip_special_tokens=True)
        if isinstance(prompts[0], list):
            return [[{"role": "assistant", "content": t}] for t in texts]
        return texts

    def per_function(self, rows: list[int], ids: list[list[int]]) -> torch.Tensor:
        """[completions, functions] rewards; None is NaN, a list of the wrong length refused
        with the function named."""
        given = [self.rows(r) for r in rows]
        prompts = [g["prompt"] for g in given]
        completions = self.completions(prompts, ids)
        columns = {k: [g[k] for g in given] for k in given[0]
                   if k not in ("prompt", "completion", "completion_ids")}
        out = torch.zeros(len(rows), len(self.functions))
        for i, (function, name) in enumerate(zip(self.functions, self.names, strict=True)):
            if isinstance(function, nn.Module):
                raise WorkbookError(f"reward model {name!r}: the pilot calls reward functions "
                                    "only", "pilot with a reward function in its place")
            try:
                values = list(function(prompts=prompts, completions=completions,
                                       completion_ids=ids, trainer_state=self.state,
                                       log_extra=lambda *a: None, log_metric=lambda *a: None,
                                       **columns))
            except Exception as exc:
                raise WorkbookError(f"the reward function {name!r} raised {type(exc).__name__}: "
                                    f"{reason(exc, 300)}", "fix the reward function: TRL calls "
                                    "it with prompts=, completions=, completion_ids= and every "
                                    "other column of the dataset as keyword lists") from exc
            if len(values) != len(rows):
                raise WorkbookError(
                    f"the reward function {name!r} returned {len(values)} rewards for "
                    f"{len(rows)} completions ({len(set(rows))} prompts x num_generations)",
                    "return one reward per completion, in the order of `completions` (TRL "
                    "refuses the list with a ValueError at the first step)")
            out[:, i] = torch.tensor([math.nan if v is None else float(v) for v in values])
        return out

    def batch_dependence(self, rows: list[int], ids: list[list[int]], rewards: torch.Tensor,
                         shown: list[str]) -> list[Flag]:
        """Reward functions whose reward of a completion changes with the completions it is
        scored beside: each called again on every completion alone. TRL calls them once per
        generation batch, so such a reward depends on the batch size and the ranks."""
        alone = torch.cat([self.per_function([r], [c]) for r, c in zip(rows, ids, strict=True)])
        moved = ((alone - rewards).abs() > 1e-6 * (1 + rewards.abs())) & ~rewards.isnan()
        return [Flag("reward depends on its batch", f"the reward function {name!r} scores "
                     f"{int(m.sum())} of {len(rows)} completions differently when it is called "
                     "on each alone than on the whole batch: a completion's reward depends on "
                     "the others scored with it (normalised by the batch's own maximum or "
                     "mean?), so it changes with generation_batch_size and the number of GPUs",
                     int(m.sum()), f"make {name!r} score each completion by itself; TRL "
                     "normalises the rewards within each group already (scale_rewards)", shown)
                for name, m in zip(self.names, moved.T, strict=True) if bool(m.any())]

    def advantages(self, rewards: torch.Tensor, generations: int) -> torch.Tensor:
        """TRL's advantages (sum_then_normalize), with TRL's own `nanstd`: each reward less its
        group's mean, divided by the group's (or the batch's) standard deviation unless
        scale_rewards is 'none'; NaN (an unscorable completion, a group or batch with fewer
        than two rewards) becomes 0, no learning signal, as TRL makes it."""
        from trl.trainer.utils import nanstd  # a GRPOTrainer was given: trl is installed

        grouped = rewards.view(-1, generations)
        mean = grouped.nanmean(1, keepdim=True)
        if self.scale == "batch":
            std = nanstd(rewards).expand_as(grouped)
        else:
            std = nanstd(grouped, dim=1).unsqueeze(1).expand_as(grouped)
        out = grouped - mean
        if self.scale != "none":
            out = out / (std + 1e-4)
        return out.reshape(-1).nan_to_num(0.0)

    @staticmethod
    def flat(rewards: torch.Tensor, generations: int) -> torch.Tensor:
        """Per group, whether its rewards tell no completion apart (every advantage 0, no
        gradient): all equal, or fewer than two scored (TRL's `nanstd` is NaN there)."""
        from trl.trainer.utils import nanstd

        return nanstd(rewards.view(-1, generations), dim=1).nan_to_num(0) < 1e-6


def token_logps(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, keep: int,
                temperature: float) -> torch.Tensor:
    """The log-probability of each of the last `keep` tokens, from logits divided by the
    sampling temperature (TRL's `_get_per_token_logps_and_entropies`)."""
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    logits = logits[:, -keep - 1:-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, ids[:, -keep:, None]).squeeze(-1)


class GRPOPolicy(BesideReference):
    """The policy and its reference as one model whose forward is a GRPO micro-step on its
    prompts: it samples, scores, and returns per completion [loss numerator, reward, weight]
    (`LOSS`, `REWARD`, `WEIGHT`) laid out [prompts, num_generations, 3]. The reference is a
    frozen copy, or - `reference` None with beta > 0, as TRL does for PEFT - the policy's base
    with the adapters off; with beta 0 none runs."""

    SHARED = (*BesideReference.SHARED, "config")

    def __init__(self, policy: nn.Module, reference: nn.Module | None, rewards: Rewards,
                 settings: dict[str, Any], rows: int):
        super().__init__(policy, reference)
        self.rewards, self.settings = rewards, settings
        # how often each prompt was drawn in training: its next completions' seed
        self.register_buffer("draws", torch.zeros(rows, dtype=torch.long))

    def sample(self, ids: torch.Tensor, mask: torch.Tensor,
               rows: torch.Tensor) -> list[list[int]]:
        """`num_generations` completions per prompt, each prompt's from its own seeded stream
        (training draws anew each time; evaluation draws the same completions every time),
        cut after the first end token as TRL cuts them."""
        s = self.settings
        out: list[list[int]] = []
        devices = [ids.device] if ids.device.type == "cuda" else []
        for prompt, real, row in zip(ids, mask.bool(), rows.tolist(), strict=True):
            draw = int(self.draws[row]) if self.training else -1
            with torch.random.fork_rng(devices=devices):
                torch.manual_seed(s["seed"] + row * SEED_STRIDE + draw + 1)
                given = prompt[real][None].expand(s["generations"], -1)
                made = self.policy.generate(input_ids=given, attention_mask=torch.ones_like(
                    given), generation_config=s["generation_config"])[:, given.shape[1]:]
            for seq in made.tolist():
                ends = [i for i, t in enumerate(seq) if t in s["eos"]]
                out.append(seq[:ends[0] + 1] if ends else seq)
        if self.training:
            self.drawn(rows)
        return out

    def drawn(self, rows: torch.Tensor) -> None:
        """Count a training draw of each of `rows` - of every rank's rows when several
        processes train (each samples its own prompts; every replica keeps the same counts,
        so a checkpoint written by one resumes them all)."""
        counts = torch.zeros_like(self.draws)
        counts.index_add_(0, rows.to(counts.device), torch.ones_like(rows, device=counts.device))
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(counts)
        self.draws += counts

    @contextlib.contextmanager
    def clock(self, phase: str) -> Iterator[None]:
        """Time one phase of the forward; on a GPU, the memory allocated and reserved after
        it (03 shows them beside its gates: `phases_said`)."""
        cuda = torch.cuda.is_available() and any(p.is_cuda for p in self.policy.parameters())
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        yield
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        self.phases.append((phase, seconds, torch.cuda.memory_allocated() if cuda else None,
                            torch.cuda.memory_reserved() if cuda else None))
        spent = self.__dict__.setdefault("spent", {})
        spent[phase] = spent.get(phase, 0.0) + seconds

    def phase_seconds(self) -> dict[str, float]:
        """Seconds spent in each phase over every forward so far: 03 takes generation's share
        of an update from the readings before and after it."""
        return dict(self.__dict__.get("spent", {}))

    def phases_said(self) -> str | None:
        """The phases of the last forward in words: generation with its tokens per second,
        rewards, reference and policy log-probs, their share of the forward's time."""
        phases = getattr(self, "phases", None)
        if not phases:
            return None
        total = sum(p[1] for p in phases) or 1.0

        def said(name: str, seconds: float, allocated: int | None, reserved: int | None) -> str:
            rate = f", {self.tokens} tokens, {self.tokens / max(seconds, 1e-9):.3g} tokens/s" \
                if name == "generation" else ""
            memory = f", allocated {allocated / 2**20:.4g} MiB, reserved " \
                f"{reserved / 2**20:.4g} MiB" if allocated is not None else ""
            return f"{name} {seconds:.3g} s ({seconds / total:.0%}{rate}{memory})"
        return "GRPO's forward: " + "; ".join(said(*p) for p in phases)

    def draw(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
             row: torch.Tensor) -> tuple[list[list[int]], torch.Tensor, torch.Tensor]:
        """(the completions, [completions, functions] rewards, the weighted reward of each:
        NaN where no function scored it) of one batch of prompts."""
        with torch.no_grad(), self.clock("generation"):
            completions = self.sample(input_ids, attention_mask, row)
        self.tokens = sum(map(len, completions))
        rows = row.repeat_interleave(self.settings["generations"]).tolist()
        with self.clock("rewards"):
            rewards = self.rewards.per_function(rows, completions)
        weighted = (rewards * self.rewards.weights).nansum(1)
        weighted[rewards.isnan().all(1)] = math.nan
        return completions, rewards, weighted

    def audit(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, row: torch.Tensor,
              ids: list[str]) -> list[Flag]:
        """01's findings on the policy's own completions of these prompts, scored by the
        user's reward functions: None/NaN rewards, groups whose rewards are all equal (no
        advantage, no gradient), completions cut at max_completion_length."""
        s, g = self.settings, self.settings["generations"]
        completions, rewards, weighted = self.draw(input_ids, attention_mask, row)
        n, shown, flags = len(completions), ids[:5], []
        drawn = f"{n} completions the policy sampled for {n // g} training prompts"
        for name, values in zip(self.rewards.names, rewards.T, strict=True):
            missing = int(values.isnan().sum())
            if missing:
                flags.append(Flag(
                    "reward None or NaN", f"the reward function {name!r} returned None or NaN "
                    f"for {missing} of {drawn}: TRL keeps them as NaN, leaves them out of the "
                    "group's mean, and a completion no function scores gets no advantage",
                    missing, f"return a number for every completion from {name!r} (e.g. 0.0 "
                    "for one it cannot parse)", shown))
        flags += self.rewards.batch_dependence(row.repeat_interleave(g).tolist(), completions,
                                               rewards, shown)
        flat = self.rewards.flat(weighted, g)
        if flat.float().mean() >= FLAT_SHARE:
            constant = [name for name, values in zip(self.rewards.names, rewards.T, strict=True)
                        if bool(self.rewards.flat(values, g).all())]
            flags.append(Flag(
                "groups with equal rewards", f"{int(flat.sum())} of {len(flat)} prompts' groups "
                f"of {g} completions have rewards all equal (TRL's frac_reward_zero_std "
                f"{float(flat.float().mean()):.2f}): their advantages are 0 and they give no "
                "gradient" + (f"; the reward function(s) {constant} give every completion of a "
                              "prompt the same value" if constant else ""), int(flat.sum()),
                "make the reward tell a prompt's completions apart (partial credit, a graded "
                "score rather than a prompt-level value), or raise num_generations or the "
                "temperature", shown))
        cut = sum(1 for c in completions if not c or c[-1] not in s["eos"])
        if cut / n >= CUT_SHARE:
            flags.append(Flag(
                "completions cut at max_completion_length", f"{cut} of {drawn} reach "
                f"max_completion_length={s['max_completion_length']} without an end token "
                "(TRL's completions/clipped_ratio): the rewards score answers cut short"
                + ("" if s["mask_truncated"] else ", and the loss trains on them"), cut,
                "raise max_completion_length so completions end, or set "
                "mask_truncated_completions=True to leave cut ones out of the loss", shown))
        return flags

    def reference_logps(self, ids: torch.Tensor, mask: torch.Tensor,
                        width: int) -> torch.Tensor:
        """The reference's log-probs of the completions (`on_reference`)."""
        return self.on_reference(lambda m: token_logps(m, ids, mask, width,
                                                       self.settings["temperature"]))

    def sized(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The micro-step on fake tensors (03/05/08's prediction): no values to sample or
        score, so every completion is max_completion_length tokens long - the generation's
        KV cache at its end (one forward over prompt and completion that keeps its cache and
        the last position's logits), then the reference's forward (beta > 0) and the policy's
        forward with the loss's graph."""
        s, g = self.settings, self.settings["generations"]
        width = s["max_completion_length"]
        ids = input_ids.repeat_interleave(g, 0)
        ids = torch.cat([ids, ids.new_zeros(ids.shape[0], width)], 1)
        mask = torch.cat([attention_mask.repeat_interleave(g, 0),
                          attention_mask.new_ones(ids.shape[0], width)], 1)
        with torch.no_grad():  # generation ends holding the cache of every position, the
            # logits of the last only; it is freed before the log-probs are taken
            cache = self.policy(input_ids=ids, attention_mask=mask, use_cache=True,
                                logits_to_keep=1).past_key_values
            del cache
            if s["beta"]:
                self.reference_logps(ids, mask, width)
        logps = token_logps(self.policy, ids, mask, width, s["temperature"])
        numerator = -(torch.exp(logps - logps.detach())).sum(1)
        out = torch.stack([numerator, torch.zeros_like(numerator),
                           torch.full_like(numerator, width)], -1)
        return out.view(-1, g, 3)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                row: torch.Tensor) -> torch.Tensor:
        s, g = self.settings, self.settings["generations"]
        if is_fake(input_ids) or input_ids.is_meta:
            return self.sized(input_ids, attention_mask)
        self.phases: list[tuple[str, float, int | None, int | None]] = []
        completions, _, weighted = self.draw(input_ids, attention_mask, row)
        device = input_ids.device
        advantages = self.rewards.advantages(weighted, g).to(device)
        width = s["max_completion_length"]  # the limit: a step sized for its longest draws
        done = torch.tensor([[1] * len(c) + [0] * (width - len(c)) for c in completions],
                            device=device)
        tail = torch.tensor([c + [s["pad"]] * (width - len(c)) for c in completions],
                            device=device)
        ids = torch.cat([input_ids.repeat_interleave(g, 0), tail], 1)
        mask = torch.cat([attention_mask.repeat_interleave(g, 0), done], 1)
        loss_mask = done.float()
        if s["mask_truncated"]:
            cut = torch.tensor([not c or c[-1] not in s["eos"] for c in completions],
                               device=device)
            loss_mask = loss_mask * (~cut)[:, None]
        with self.clock("policy log-probs (with the loss's graph)"):
            logps = token_logps(self.policy, ids, mask, width, s["temperature"])
        coef = torch.exp(logps - logps.detach())  # 1: one update per generation, on-policy
        per_token = -torch.min(coef * advantages[:, None],
                               coef.clamp(1 - s["epsilon_low"], 1 + s["epsilon_high"])
                               * advantages[:, None])
        if s["beta"]:
            with torch.no_grad(), self.clock("reference log-probs"):
                ref = self.reference_logps(ids, mask, width)
            per_token = per_token + s["beta"] * (torch.exp(ref - logps) - (ref - logps) - 1)
        summed = (per_token * loss_mask).sum(1)
        tokens = loss_mask.sum(1)
        if s["loss_type"] == "grpo":  # each completion's token mean; weighed as one
            numerator, weight = summed / tokens.clamp(min=1), torch.ones_like(tokens)
        elif s["loss_type"] == "dr_grpo":  # a fixed divisor: max_completion_length
            numerator, weight = summed, torch.full_like(tokens, s["max_completion_length"])
        else:  # dapo, bnpo: the update's tokens
            numerator, weight = summed, tokens
        out = torch.stack([numerator, weighted.to(device).to(numerator.dtype), weight], -1)
        return out.view(-1, g, 3)


def _kept(outputs: torch.Tensor, batch: dict) -> torch.Tensor:
    """[prompts, 1]: 1 for a prompt with a target, 0 for evaluation's padding copies."""
    return batch["labels"].ne(-100).to(outputs.dtype).reshape(-1, 1)


def policy_loss(outputs: torch.Tensor, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed, count): minus the reward per unit of weight as the value, the gradient of
    TRL's loss; the workbook divides by the update's summed weight, as TRL normalises."""
    kept = _kept(outputs, batch)
    numerator, reward, weight = (x * kept for x in outputs.unbind(-1))
    value = -(reward.detach() * weight.detach()).nansum()
    return value + (numerator.sum() - numerator.sum().detach()), weight.detach().sum()


def policy_metrics(outputs: torch.Tensor, batch: dict) -> dict[str, tuple[float, float]]:
    """The mean reward per completion, and the share of groups whose rewards are all equal
    (TRL's frac_reward_zero_std: zero advantage, no gradient)."""
    kept = _kept(outputs, batch).reshape(-1).bool()
    reward = outputs[kept][..., REWARD].detach().float()
    spread = reward.std(-1) if reward.shape[-1] > 1 else torch.zeros(reward.shape[0])
    return {"reward": (float(reward.nansum()), float((~reward.isnan()).sum())),
            "zero_std_groups": (float((spread.nan_to_num(0) < 1e-6).sum()),
                                float(reward.shape[0]))}


def _checked(trainer: Any) -> list[str]:
    """What of the trainer's GRPO setup the pilot runs differently, in words; what it does not
    compute is refused with the fix."""
    refused = []
    if trainer.loss_type not in LOSSES:
        refused.append(f"loss_type={trainer.loss_type!r} (the pilot computes {LOSSES})")
    for name, value, plain in (
            ("use_vllm", getattr(trainer, "use_vllm", False), False),
            ("multi_objective_aggregation", getattr(trainer, "multi_objective_aggregation",
                                                    "sum_then_normalize"),
             "sum_then_normalize"),
            ("importance_sampling_level", getattr(trainer, "importance_sampling_level", "token"),
             "token"),
            ("top_entropy_quantile", getattr(trainer, "top_entropy_quantile", 1.0), 1.0),
            ("tools", bool(getattr(trainer, "tools", None)), False),
            ("rollout_func", getattr(trainer, "rollout_func", None) is not None, False)):
        if value != plain:
            refused.append(f"{name}={value!r}")
    if refused:
        raise WorkbookError(f"the GRPOTrainer's {', '.join(refused)} is not mapped",
                            "pilot the same run with TRL's defaults for these (the generation, "
                            "rewards and loss of one GRPO update stay the same), or write a "
                            "workbook.Task with your update")
    notes = []
    if trainer.loss_type == "bnpo":
        notes.append("from_trainer: loss_type 'bnpo' divides each micro-batch by its own "
                     "tokens; the pilot divides the update by all its tokens (as 'dapo')")
    if trainer.scale_rewards == "batch":
        notes.append("from_trainer: scale_rewards 'batch': the pilot divides by the standard "
                     "deviation of each micro-batch's rewards, TRL by the generation batch's")
    if getattr(trainer, "num_iterations", 1) != 1 or trainer.args.steps_per_generation != \
            trainer.args.gradient_accumulation_steps:
        notes.append("from_trainer: the pilot generates for every update and takes one step on "
                     "it (num_iterations 1, steps_per_generation = gradient_accumulation_steps)")
    return notes


class GRPOAdapter(SplitRows):
    """A GRPOTrainer as built, as a Task of the "policy" kind: `__init__` reads its prompts,
    reward functions, tokenizer and GRPOConfig; each prompt is encoded as the policy sees it
    (the chat template with the generation prompt, TRL's own `_tokenize_prompts`), collated
    left-padded, and the model is `build_model`'s `GRPOPolicy`; `task()` assembles them."""

    def __init__(self, trainer: Any, fresh: Callable[[Callable[[Any], nn.Module]], nn.Module], *,
                 name: str, group_column: str | None, **task_fields: Any):
        self.notes = _checked(trainer)
        self.data = {"train": trainer.train_dataset}
        if isinstance(trainer.eval_dataset, dict):
            raise WorkbookError("the GRPOTrainer's eval_dataset is a dict of datasets",
                                "give it one eval_dataset of prompts (the pilot evaluates the "
                                "reward on it), or none: the pilot then holds prompts out")
        if trainer.eval_dataset is not None:
            self.data["validation"] = trainer.eval_dataset
        else:  # as the TRL docs build it: prompts held out of train_dataset, by group
            self.notes.append("from_trainer: the GRPOTrainer has no eval_dataset: the pilot "
                              "evaluates the reward on prompts of train_dataset held out by "
                              "group (Task.split_fractions)")
        self.group_column = group_column
        self.check_columns("GRPOTrainer", ("prompt",), "give the trainer rows with a 'prompt' "
                           "(text or a list of messages)")
        self.trainer, self.fresh, self.name = trainer, fresh, name
        self.tokenizer, self.args = trainer.processing_class, trainer.args
        self.offset = len(self.data["train"])  # a row's global index: train rows first
        self.rewards = Rewards(trainer, self.row)
        self.settings = {
            "generations": int(trainer.num_generations), "seed": int(trainer.args.seed),
            "generation_config": trainer.generation_config, "eos": set(trainer.eos_token_ids),
            "pad": trainer._tokenizer.pad_token_id, "temperature": float(trainer.temperature),
            "beta": float(trainer.beta), "loss_type": trainer.loss_type,
            "epsilon_low": float(trainer.epsilon_low), "epsilon_high": float(trainer.epsilon_high),
            "mask_truncated": bool(trainer.mask_truncated_completions),
            "max_completion_length": int(trainer.max_completion_length)}
        self.task_fields = task_fields

    def row(self, index: int) -> dict:
        """The dataset row of a global index (train rows first, then the eval rows)."""
        split = "train" if index < self.offset else "validation"
        return self.data[split][index - (0 if split == "train" else self.offset)]

    def load_examples(self) -> list[dict]:
        """Every prompt of both splits."""
        return self.examples(target="reward")

    def encode(self, ex: dict) -> dict[str, torch.Tensor]:
        """The prompt's tokens as the policy sees them (TRL's own tokenisation: the chat
        template with the generation prompt), its global row, one target."""
        prompt = self.data[ex["split"]][ex["index"]]["prompt"]
        ids = self.trainer._tokenize_prompts([prompt])[0][0]
        row = ex["index"] + (self.offset if ex["split"] == "validation" else 0)
        return {"input_ids": torch.tensor(ids, dtype=torch.long),
                "attention_mask": torch.ones(len(ids), dtype=torch.long),
                "row": torch.tensor(row), "labels": torch.tensor(0)}

    def collate(self, items: list[dict]) -> dict[str, torch.Tensor]:
        """The prompts left-padded, as TRL pads them for generation."""
        width = max(len(it["input_ids"]) for it in items)
        pad = self.settings["pad"]

        def left(t: torch.Tensor, value: int) -> torch.Tensor:
            return torch.cat([t.new_full((width - len(t),), value), t])
        return {"input_ids": torch.stack([left(it["input_ids"], pad) for it in items]),
                "attention_mask": torch.stack([left(it["attention_mask"], 0) for it in items]),
                "row": torch.stack([it["row"] for it in items]),
                "labels": torch.stack([it["labels"] for it in items])}

    def build_model(self) -> nn.Module:
        """The policy beside its reference, of a trainer built anew."""
        return self.fresh(lambda t: self.around(t.model, t.ref_model))

    @staticmethod
    def decode(ids: Any) -> str:
        return "reward"

    def decode_input(self, ids: Any) -> str:
        return self.tokenizer.decode([int(i) for i in ids if int(i) != self.settings["pad"]])

    def task(self) -> Task:
        fields = argument_fields(self.args, lambda: len(self.data["train"]), None,
                                 self.tokenizer, self.notes)
        fields.setdefault("pretrained", True)
        fields.update(self.task_fields)
        s = self.settings
        task = Task(name=self.name, kind="policy", load_examples=self.load_examples,
                    encode=self.encode, collate=self.collate, build_model=self.build_model,
                    model_inputs=INPUTS, label_names=["reward"],
                    split_of=self.split_of if "validation" in self.data else None,
                    label_field="target", padding_side="left", decode=self.decode,
                    decode_input=self.decode_input, loss=policy_loss, metrics=policy_metrics,
                    **fields)
        task.framework.notes = [
            f"from_trainer: a {type(self.trainer).__name__}'s prompts, reward functions "
            f"({', '.join(self.rewards.names)}, weights {self.rewards.weights.tolist()}) and "
            f"GRPOConfig; each update samples {s['generations']} completions per prompt (at "
            f"most {s['max_completion_length']} tokens), scores them and takes TRL's "
            f"{s['loss_type']!r} loss (scale_rewards {self.rewards.scale!r}, beta "
            f"{s['beta']:g}); the loss shown is minus the mean reward", *self.notes]
        task.framework.policy_around = self.around  # a campaign model of the same run
        return task

    def around(self, policy: nn.Module, reference: nn.Module | None) -> GRPOPolicy:
        """`policy` (and its frozen reference, None under PEFT or with beta 0) as this
        trainer's GRPO policy: a campaign model of the same run (`Task.campaign_model`)."""
        return GRPOPolicy(policy, reference, self.rewards, self.settings,
                          self.offset + len(self.data.get("validation", ())))


def from_grpo(trainer: Any, fresh: Callable[[Callable[[Any], nn.Module]], nn.Module], *,
              name: str, group_column: str | None, **task_fields: Any) -> Task:
    """A Task of the "policy" kind from a GRPOTrainer as built: its prompts, reward functions,
    tokenizer and GRPOConfig; `fresh(pick)` builds the trainer again and returns
    `pick(trainer)` (the pilot's fresh model)."""
    return GRPOAdapter(trainer, fresh, name=name, group_column=group_column,
                       **task_fields).task()
