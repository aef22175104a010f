"""The one `Event` type and `Reporter` protocol: what the pipeline and the trainer tell the CLI or the worker."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

Level = Literal["info", "warning", "error"]

LOG = "log"  # the kind of a log line about a stage: `data["kind"]` names the stage


@dataclass(frozen=True)
class Event:
    """One thing a run says. A `kind` in `peagle_core.keys.STAGES` enters that stage; `LOG` (with
    `data["kind"]`, see `Event.log`) and any other kind (e.g. "epoch", "resume") are log lines."""

    kind: str
    message: str
    data: Mapping[str, Any] = field(default_factory=dict)
    level: Level = "info"

    @classmethod
    def log(cls, kind: str, message: str, /, *, level: Level = "info", **data: Any) -> Event:
        """A log line about `kind` (a stage's name, say, without entering that stage)."""
        return cls(LOG, message, {"kind": kind, **data}, level)


class Reporter(Protocol):
    """Who hears a run: its events, and its metrics (a training step's, or an evaluation's `eval/` keys)."""

    def on_event(self, event: Event) -> None: ...

    def on_metrics(self, metrics: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class CallbackReporter:
    """A `Reporter` from two optional functions (neither: a reporter that ignores everything)."""

    events: Callable[[Event], None] | None = None
    metrics: Callable[[dict[str, Any]], None] | None = None

    def on_event(self, event: Event) -> None:
        if self.events is not None:
            self.events(event)

    def on_metrics(self, metrics: dict[str, Any]) -> None:
        if self.metrics is not None:
            self.metrics(metrics)
