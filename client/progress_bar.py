"""A job's live progress bar from its API record and events: stage, step/total, tokens/s, loss and ETA.

`peagle jobs logs -f` and `peagle demo` draw it with rich; where stdout is not a terminal (CI, pipes) it
prints a plain line at each stage or sub-step change and every `every_s` seconds instead of redrawing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from client.sdk import TERMINAL_STATUSES
from peagle_core.keys import REGENERATE, TRAIN

if TYPE_CHECKING:
    from rich.console import Console, RenderableType
    from rich.live import Live

    from client.sdk import PeagleClient

JobRecord = dict[str, Any]


@dataclass(frozen=True)
class Snapshot:
    """What the bar shows at one moment: a title (the status, or the stage and what it is doing), a count
    where the stage has one, and the figures the job reports."""

    title: str
    done: int | None = None
    total: int | None = None
    unit: str = ""
    tokens_per_s: float | None = None
    loss: float | None = None
    eta_s: float | None = None

    @property
    def counted(self) -> bool:
        return self.done is not None and bool(self.total)

    def figures(self, *, compact: bool = False) -> str:
        """E.g. `120/400 steps (30%) | 1,843 tok/s | loss 2.3140 | eta 3m12s`: what is known (`compact`, beside
        a drawn bar: `120/400 | ...`)."""
        parts = []
        if self.done is not None and self.total:
            unit = f" {self.unit}" if self.unit else ""
            count = f"{self.done}/{self.total}"
            parts.append(count if compact else f"{count}{unit} ({100 * self.done / self.total:.0f}%)")
        if self.tokens_per_s is not None:
            parts.append(f"{self.tokens_per_s:,.0f} tok/s")
        if self.loss is not None:
            parts.append(f"loss {self.loss:.4f}")
        if self.eta_s is not None:
            parts.append(f"eta {compact_duration(self.eta_s)}")
        return " | ".join(parts)


@dataclass(frozen=True)
class _Doing:
    """The stage's latest event: its message, and its count where it has one (`data.done`/`data.total`,
    e.g. the speed-up timing's rounds), with the ETA that count's pace gives as of `seen_at`."""

    label: str
    done: int | None
    total: int | None
    eta_s: float | None
    seen_at: float  # the bar's clock when it arrived
    unit: str = ""  # what it counts (`data.unit`, e.g. the hidden-state build's tokens)


class JobProgressBar:
    """Feed it the job record of each poll (`job`) and the job's events in order (`event`); it draws a live
    bar on a terminal and prints plain lines elsewhere (`live`: default, whether `console` is interactive).

    Use it as a context manager; `follow` runs the whole poll loop over the API.
    """

    def __init__(
        self,
        console: Console | None = None,
        *,
        live: bool | None = None,
        every_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        from rich.console import Console

        self.console = console if console is not None else Console()
        self.live = self.console.is_interactive if live is None else live
        self.every_s = every_s
        self._clock = clock
        self._started = clock()
        self._job: JobRecord = {}
        self._stage: str | None = None  # from the latest stage event (the job record may lag a poll)
        self._stage_data: dict[str, Any] = {}  # that event's data (the train stage's `total_steps`)
        self._doing: _Doing | None = None
        self._first: tuple[datetime, int] | None = None  # the first counted event of the current series
        self._printed: tuple[Snapshot, str, float] | None = None  # the last plain line's, its text and when
        self._printed_last = False  # nothing was printed after that line
        self._live: Live | None = None
        self._spinner: Any = None

    # -- feeding ------------------------------------------------------------------------------------

    def job(self, job: JobRecord) -> None:
        """The job record as GET /v1/jobs/{id} answers it; prints a plain line when one is due."""
        self._job = job
        # An ended job's line is printed last, when the bar closes.
        if not self.live and str(job.get("status")) not in TERMINAL_STATUSES:
            self._print_due()

    def event(self, event: dict[str, Any]) -> None:
        """One of the job's events, in order: a stage event enters that stage; the stage's other info
        events say what it is doing (with a count when their data carries `done` and `total`)."""
        data = event.get("data") or {}
        if event.get("type") == "stage":
            self._stage, self._stage_data = data.get("stage") or self._stage, data
            self._doing = self._first = None
        elif event.get("type") == "status" or event.get("level", "info") != "info":
            return  # the job record carries the status; warnings are printed, not kept as the title
        done, total = data.get("done"), data.get("total")
        if not (isinstance(done, int) and isinstance(total, int) and total > 0):
            done = total = None
        unit = data.get("unit") if isinstance(data.get("unit"), str) else ""
        self._doing = _Doing(str(event.get("message") or ""), done, total, self._eta(event, done, total),
                             self._clock(), unit[:32])  # fmt: skip

    def _eta(self, event: dict[str, Any], done: int | None, total: int | None) -> float | None:
        """The time left at the pace of this series of counted events (their server timestamps, so a replayed
        history gives the same pace as a live one)."""
        at = _timestamp(event.get("created_at"))
        if done is None or total is None or at is None:
            self._first = None
            return None
        if self._first is None or done <= self._first[1]:
            self._first = (at, done)
            return None
        per_step = (at - self._first[0]).total_seconds() / (done - self._first[1])
        return per_step * (total - done)

    # -- what it shows ------------------------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        job = self._job
        status = str(job.get("status") or "queued")
        p = job.get("progress") or {}
        if status in TERMINAL_STATUSES:
            return Snapshot(
                status, _int(p.get("step")), _int(p.get("total_steps")), "steps", loss=_num(p.get("loss"))
            )
        stage = self._stage or p.get("stage")
        if status == "queued" or not stage:
            return Snapshot(status)
        title = stage if status == "running" else f"{status}: {stage}"
        if stage == TRAIN:
            # Before its first step the job's record has no total yet (and an earlier stage's ETA, if any): the
            # stage's announcement has the total.
            total = _int(p.get("total_steps")) or _int(self._stage_data.get("total_steps"))
            step = _int(p.get("step")) or 0
            return Snapshot(
                title, step, total, "steps", tokens_per_s=_num(p.get("tokens_per_s")), loss=_num(p.get("loss")),
                eta_s=_num(p.get("eta_s")) if step else None,
            )  # fmt: skip
        regen = p.get(REGENERATE)
        if stage == REGENERATE and isinstance(regen, dict):
            return Snapshot(
                title, _int(regen.get("done")), _int(regen.get("total")), "conversations",
                tokens_per_s=_num(regen.get("tokens_per_s")), eta_s=_num(regen.get("eta_s")),
            )  # fmt: skip
        doing = self._doing
        if doing is None:
            return Snapshot(title)
        # Counted down from when the count arrived, so the ETA moves between two events.
        eta = None if doing.eta_s is None else max(0.0, doing.eta_s - (self._clock() - doing.seen_at))
        return Snapshot(
            f"{title}: {doing.label}" if doing.label else title,
            doing.done,
            doing.total,
            doing.unit,
            eta_s=eta,
        )

    def __rich__(self) -> RenderableType:
        from rich.progress_bar import ProgressBar
        from rich.spinner import Spinner
        from rich.table import Table
        from rich.text import Text

        snap = self.snapshot()
        if self._spinner is None:
            self._spinner = Spinner("dots", style="progress.spinner")
        ended = str(self._job.get("status")) in TERMINAL_STATUSES
        elapsed, figures = compact_duration(self._clock() - self._started), snap.figures(compact=True)
        bar_width = max(10, min(30, self.console.width - len(snap.title) - len(elapsed) - len(figures) - 8))
        # On a narrow terminal the figures, last, are cut; never the stage or the elapsed time.
        grid = Table.grid(padding=(0, 1))
        grid.add_column(min_width=1)
        grid.add_column(no_wrap=True, overflow="ellipsis", min_width=min(len(snap.title), 40))
        grid.add_column(width=bar_width)
        grid.add_column(no_wrap=True, min_width=len(elapsed), style="progress.elapsed")
        grid.add_column(no_wrap=True, overflow="ellipsis")
        if ended:  # nothing moves any more: full when it succeeded, else empty
            bar = ProgressBar(total=1, completed=int(snap.title == "succeeded"), width=bar_width)
        else:
            total = snap.total if snap.counted else None
            bar = ProgressBar(total=total, completed=snap.done or 0, width=bar_width, pulse=total is None)
        grid.add_row(
            Text(" ") if ended else self._spinner,
            Text(snap.title, style="progress.description"),
            bar,
            Text(elapsed),
            Text(figures),
        )
        return grid

    # -- output -------------------------------------------------------------------------------------

    def print(self, line: str) -> None:
        """A line above the bar (or between the plain lines), printed as is."""
        self.console.print(line, markup=False, emoji=False, highlight=False, soft_wrap=True)
        self._printed_last = False

    def _print_due(self, *, final: bool = False) -> None:
        """The plain line when the title changed or `every_s` passed since the last one; `final`: unless the
        last thing printed was this very line."""
        now, snap = self._clock(), self.snapshot()
        text = _text(snap)
        if self._printed is not None:
            last, last_text, at = self._printed
            if final and text == last_text and self._printed_last:
                return
            if not final and snap.title == last.title and now - at < self.every_s:
                return
        self.print(f"[{compact_duration(now - self._started)}] {text}")
        self._printed, self._printed_last = (snap, text, now), True

    def __enter__(self) -> JobProgressBar:
        if self.live:
            from rich.live import Live

            self._live = Live(self, console=self.console, refresh_per_second=4, transient=False)
            self._live.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.stop()  # a last draw leaves the final state on screen
            self._live = None
        elif self._job:
            self._print_due(final=True)

    def follow(
        self,
        client: PeagleClient,
        job_id: str,
        *,
        show: Callable[[dict[str, Any]], str | None],
        on_job: Callable[[JobRecord], None] | None = None,
        poll_s: float = 1.0,
    ) -> JobRecord:
        """Poll the job until it ends and every event was seen, feeding the bar; `show` turns an event into
        the line printed above the bar (None: not printed), `on_job` also sees each poll's record. Returns the
        final job record."""

        def seen(job: JobRecord) -> None:
            self.job(job)
            if on_job is not None:
                on_job(job)

        for event in client.follow_events(job_id, on_job=seen, poll_s=poll_s):
            self.event(event)
            if (line := show(event)) is not None:
                self.print(line)
        return self._job


def compact_duration(seconds: float) -> str:
    """`45s`, `3m12s`, `1h02m`."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _text(snap: Snapshot) -> str:
    figures = snap.figures()
    return f"{snap.title}  {figures}" if figures else snap.title


def _timestamp(value: Any) -> datetime | None:
    try:
        return datetime.fromisoformat(str(value))
    except ValueError:
        return None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None
