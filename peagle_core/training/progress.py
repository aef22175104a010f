"""Where a training run stands: step, data position, last metrics and evaluation, stop and divergence state."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from peagle_core.serving.report import EvaluationReport
from peagle_core.training.resume import TrainingState


@dataclass
class Progress:
    """Where the loop stands: what a checkpoint records and the result reports."""

    step: int = 0
    epoch: int = 0
    bins_done: int = 0  # the epoch's packed rows consumed so far, over all ranks
    metrics: dict[str, Any] = field(default_factory=dict)  # the last step's
    checkpoint: Path | None = None  # the newest training checkpoint
    evaluation: EvaluationReport | None = None  # the last evaluation's
    stopped: bool = False
    nonfinite_steps: int = 0  # consecutive steps whose loss or gradient norm was NaN/infinite

    @classmethod
    def resumed(cls, state: TrainingState | None) -> Progress:
        """Progress at a restored checkpoint's data position (the start when there is none)."""
        if state is None:
            return cls()
        at = state.position
        return cls(step=at.step, epoch=at.epoch, bins_done=at.bins_done, checkpoint=state.path)

    def running(self, total_steps: int) -> bool:
        return not self.stopped and self.step < total_steps

    def advance(self, step_bins: int) -> None:
        """One optimizer step over `step_bins` packed rows (all ranks together) is done."""
        self.step += 1
        self.bins_done += step_bins
