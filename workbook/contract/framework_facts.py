"""What a framework adapter learns about the user's code while mapping it (`Task.framework`):
facts the notebooks read back by name. A hand-written Task keeps the defaults: nothing learned."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class FrameworkFacts:
    """Set by the adapters (`contract/adapters/`), read by the notebooks (01 above all)."""

    # what the adapter mapped or left out, in words (01 shows each as a note)
    notes: list[str] = field(default_factory=list)
    # per split: (rows dropped, rows given, why) - rows the framework's own preparation dropped
    # before the pilot saw them (from_trainer counts TRL's); 01 flags them
    rows_dropped: dict[str, tuple[int, int, str]] = field(default_factory=dict)
    # 01's leakage check on the rows given to the trainer, before packing joined them (a
    # packed row keeps no group): {"column", "groups" (per split), "crossing"}; None unpacked
    groups_before_packing: dict[str, Any] | None = None
    # the packing strategy the trainer's arguments name ("packing_strategy='bfd'"), None when
    # it does not pack; 01 checks each document attends to itself only
    packed: str | None = None
    # per split: rows whose label is -100 (padding), left out as no examples (from_hf counts
    # them at the end of a whole pass)
    padding_rows: dict[str, int] = field(default_factory=dict)
    # why identical inputs sit in two splits, found by experiment on the user's tokenizer:
    # () -> (cause, fix) or None (from_hf's truncation check); 01 asks only when it finds such
    duplicates_cause: Callable[[], tuple[str, str] | None] | None = None
    # Trainer values the task's code read whose pilot value differs from the campaign's:
    # name -> what each run gives (from_lightning's estimated_stepping_batches)
    campaign_differs_in: dict[str, str] = field(default_factory=dict)
    # token id -> token, for the tokens the tokenizer added past its own vocabulary (01 asks
    # whether the base ever trained their rows)
    added_tokens: dict[int, str] = field(default_factory=dict)
    # (policy, reference) -> the task's model around them, for a campaign model of the same
    # run (a GRPOTrainer's: `GRPOPolicy` with its rewards and settings); None elsewhere
    policy_around: Callable[[Any, Any], Any] | None = None
    # a reward model's pair, tokenized again without truncation: item -> (chosen ids, rejected
    # ids), or None where the row keeps no text (01 asks when a pair's two sequences are equal)
    untruncated_pair: Callable[[Any], tuple[list[int], list[int]] | None] | None = None
    # 01's checks on a reward model's own scorer (where the score is read in a padded batch,
    # whether the score head trains, the first loss): encoded items -> Flags
    pair_checks: Callable[[list], list] | None = None
    # how the framework combines each evaluation metric over data-parallel ranks, {metric:
    # reduction} (contract/metric_reduction.py), filled by the adapter's eval_step as it
    # evaluates; a metric not named is a mean over rows (09 judges each the way it is reduced)
    metric_reductions: dict[str, str] = field(default_factory=dict)
