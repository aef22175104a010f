"""The trainer's line to its caller: events and metrics (rank 0 only), stop requests and consumed samples."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from peagle_core.events import CallbackReporter, Event, Level, Reporter
from peagle_core.training import distributed as dist_utils

ConsumedFn = Callable[[int, list[int]], None]


@dataclass
class Hooks:
    """The caller's callbacks: only rank 0 tells `reporter` its events and metrics; a stop request stops every
    rank; `on_consumed(epoch, sample_ids)` hears, on every rank, the dataset samples each step trained that rank on."""

    info: dist_utils.DistInfo
    reporter: Reporter = field(default_factory=CallbackReporter)
    should_stop: Callable[[], bool] | None = None
    on_consumed: ConsumedFn | None = None

    def event(self, kind: str, message: str, /, *, level: Level = "info", **data: Any) -> None:
        if self.info.is_main:
            self.reporter.on_event(Event(kind, message, data, level))

    def report(self, metrics: dict[str, Any]) -> None:
        if self.info.is_main:
            self.reporter.on_metrics(metrics)

    def consumed(self, epoch: int, sample_ids: list[int]) -> None:
        if self.on_consumed is not None:
            self.on_consumed(epoch, sample_ids)

    def stop_requested(self, device: torch.device) -> bool:
        """A collective: every rank calls it and gets the same answer."""
        return dist_utils.any_rank(bool(self.should_stop and self.should_stop()), self.info, device)
