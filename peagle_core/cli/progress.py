"""A run's progress in a terminal for `peagle train` and the real-model benches: tqdm bars over a counted
stage (the hidden-state build's tokens) and over the training steps, and one line per other event."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, TextIO

from peagle_core.events import LOG, CallbackReporter, Event


class RunProgress:
    """A `Reporter` that draws the run on `file` (stderr by default, so that a bench's JSON lines keep
    stdout); `metrics` also hears every metrics report (a bench's own timing). Use it as a context manager:
    the bars close at the end."""

    def __init__(
        self, file: TextIO | None = None, *, metrics: Callable[[dict[str, Any]], None] | None = None
    ):
        self.file = file or sys.stderr
        self.extra_metrics = metrics
        self.steps: Any = None  # the training bar, from the first step on
        self.counted: Any = None  # the bar of a counted event series before training

    def reporter(self) -> CallbackReporter:
        return CallbackReporter(events=self.on_event, metrics=self.on_metrics)

    def on_metrics(self, m: dict[str, Any]) -> None:
        from tqdm import tqdm

        if self.extra_metrics is not None:
            self.extra_metrics(m)
        if "total_steps" not in m:  # an evaluation result
            for key, value in m.items():
                if key.startswith("eval/"):
                    self._line(f"step {m['step']}: {key} = {value:.3f}")
            return
        if self.steps is None:
            self._close_counted()
            self.steps = tqdm(total=m["total_steps"], initial=m["step"] - 1, unit="step", dynamic_ncols=True,
                              file=self.file)  # fmt: skip
        self.steps.update(m["step"] - self.steps.n)
        self.steps.set_postfix(loss=f"{m['loss']:.4f}", acc0=f"{m.get('acc_0', 0):.3f}", lr=f"{m['lr']:.2e}",
                               tok_s=f"{m['tokens_per_s']:.0f}")  # fmt: skip

    def on_event(self, event: Event) -> None:
        from tqdm import tqdm

        done, total = event.data.get("done"), event.data.get("total")
        if self.steps is None and isinstance(done, int) and isinstance(total, int) and total > 0:
            if self.counted is None or self.counted.total != total:
                self._close_counted()
                self.counted = tqdm(total=total, desc=event.message, unit=event.data.get("unit") or "it",
                                    unit_scale=True, dynamic_ncols=True, file=self.file)  # fmt: skip
            self.counted.update(done - self.counted.n)
            return
        self._close_counted()
        label = event.data.get("kind", event.kind) if event.kind == LOG else event.kind
        self._line(f"[{label}] {event.message}")

    def _line(self, text: str) -> None:
        from tqdm import tqdm

        tqdm.write(text, file=self.file)

    def _close_counted(self) -> None:
        if self.counted is not None:
            self.counted.close()
            self.counted = None

    def close(self) -> None:
        self._close_counted()
        if self.steps is not None:
            self.steps.close()
            self.steps = None

    def __enter__(self) -> RunProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
