"""Notebook 03's result: the gates, the prediction checked against them, and the rental plan
predicted and fitted to the stated device (whether it fits, needs sharding, the verdict)."""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from ...contract.task import Task
from ...training.predict import Overheads, Plan, needs_sharding
from .settings import GateReport, GateSettings


@dataclass
class GatesResult:
    """Everything notebook 03 shows: the gates at the pilot settings, the prediction checked
    against them, and the rental plan predicted and fitted to the stated device."""

    task: Task
    settings: GateSettings
    report: GateReport
    check: pd.DataFrame  # predicted against measured, at the pilot settings
    plan: Plan
    planned: pd.DataFrame  # predicted at the plan
    overheads: Overheads
    fit: pd.DataFrame
    rule: pd.DataFrame  # the "4 x model size" rule against the plan's prediction
    # why the model's forward refuses the plan's shape (its own words and the fix), or None
    plan_refused: str | None = None

    @property
    def fits(self) -> bool | None:
        """Whether the plan fits the stated device memory (None: no memory stated, or a phase
        not predicted while every predicted one fits - a fit is never judged over a phase that
        was not sized)."""
        if not self.settings.device_memory_gib:
            return None
        known = self.fit.fits.dropna()
        if not known.all():
            return False
        return None if self.unpredicted else True

    @property
    def unpredicted(self) -> list[str]:
        """The plan's phases that could not be predicted (their rows say why)."""
        return self.planned.phase[self.planned.predicted_peak_bytes.isna()].tolist()

    @property
    def needs_sharding(self) -> bool:
        """The plan fits no single GPU at any micro-batch (`predict.needs_sharding`)."""
        return self.fits is False and needs_sharding(self.fit, self.overheads,
                                                     self.settings.headroom)

    @property
    def verdict(self) -> str:
        """Fails when a gate fails or the plan does not fit the stated device - unless its
        first update alone is over the device: then the model is sharded (notebook 08 sizes
        FSDP2 over several GPUs), which 03's one-GPU fit does not judge. A plan whose shape the
        model refuses (a length beyond its position table) fails: nothing of it was sized."""
        if self.plan_refused:
            return "fail"
        if self.fits is False and not self.needs_sharding:
            return "fail"
        return self.report.verdict
