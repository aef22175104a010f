"""The trainer's checkpointing: restore the newest training checkpoint at the start, save one every
`training.checkpoint_every_steps`, at the last step and when stopping (`training.resume` holds the format)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from peagle_core.serving.report import EvaluationReport
from peagle_core.training.hooks import Hooks
from peagle_core.training.progress import Progress
from peagle_core.training.resume import DataPosition, TrainingState, restore_latest, save_checkpoint


@dataclass
class Checkpointer:
    """Saves and restores what training runs (`module`: plain, DDP or FSDP), its optimizer and schedule
    under `root`, at any world size."""

    root: Path
    every: int  # training.checkpoint_every_steps
    hooks: Hooks
    module: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler

    def restore(self) -> TrainingState | None:
        """Load the newest checkpoint into the training objects (a collective), announcing it; None when
        there is none."""
        info = self.hooks.info
        restored = restore_latest(
            self.root, module=self.module, optimizer=self.optimizer, scheduler=self.scheduler, info=info
        )
        if restored is not None:
            self.hooks.event(
                "resume",
                f"resumed from {restored.path.name} (written by {restored.world_size} ranks, now "
                f"{info.world_size})",
                step=restored.position.step,
                from_world_size=restored.world_size,
                world_size=info.world_size,
            )
        return restored

    def maybe_save(
        self, progress: Progress, evaluation: EvaluationReport | None, *, epoch_len: int, total_steps: int
    ) -> None:
        """Save a training checkpoint every `every` steps, at the last step and when stopping.

        The data position counts the epoch's packed rows consumed (0 of the next epoch when this one is
        done); with COD's randomness a function of that position, it is all a resume at any world size needs
        to continue the same trajectory. Nothing is saved during a streak of non-finite steps, so the newest
        checkpoint is always a good one.
        """
        step = progress.step
        if progress.nonfinite_steps:
            return
        if not (progress.stopped or step >= total_steps or step % self.every == 0):
            return
        at_end = progress.bins_done >= epoch_len
        position = DataPosition(
            step=step,
            epoch=progress.epoch + 1 if at_end else progress.epoch,
            bins_done=0 if at_end else progress.bins_done,
        )
        progress.checkpoint = save_checkpoint(
            self.root,
            module=self.module,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            position=position,
            info=self.hooks.info,
            metrics=progress.metrics,
            extra_json={"eval.json": evaluation.to_dict()} if evaluation is not None else None,
        )
