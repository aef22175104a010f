"""A stage runner for benchmark suites: one JSON line per check, a deadline for the run, a SIGALRM time
cap per stage, and capabilities, so a stage whose needs are missing is skipped with the reason."""

from __future__ import annotations

import contextlib
import gc
import json
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_CAP_S = 60
MIN_STAGE_S = 8  # a stage that would get less than this is skipped as out of time


class StageTimeout(BaseException):
    """A stage ran into its time cap (raised by SIGALRM in the main thread). A BaseException, like
    KeyboardInterrupt, so library code's `except Exception` fallbacks cannot swallow it."""


class CheckFailed(Exception):
    """A check ran and its result is wrong; `fields` go into its JSON line."""

    def __init__(self, message: str, **fields: Any):
        super().__init__(message)
        self.fields = fields


class Skip(Exception):
    """Raised by a stage that ran but found nothing to check here (reported as skipped with the reason)."""

    def __init__(self, reason: str, **fields: Any):
        super().__init__(reason)
        self.fields = fields


@contextlib.contextmanager
def time_cap(seconds: float) -> Iterator[None]:
    """Raise StageTimeout in the main thread once `seconds` have passed (between Python bytecodes).

    An alarm already pending (pytest-timeout's, say) is put back afterwards with its remaining time.
    """

    def on_alarm(_signum: int, _frame: Any) -> None:
        raise StageTimeout(f"stopped at its {seconds:.0f} s cap")

    t0 = time.monotonic()
    previous = signal.signal(signal.SIGALRM, on_alarm)
    outer, _ = signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer > 0:
            signal.setitimer(signal.ITIMER_REAL, max(outer - (time.monotonic() - t0), 0.01))


@dataclass
class Capability:
    """Whether a piece a stage may need (CUDA, a package, an earlier stage's product) is there, and why not."""

    ok: bool
    reason: str = ""


class Suite:
    """Runs stages in order under a deadline, emits one JSON line per check or figure, and remembers
    what each stage found (capabilities) so later stages that need a missing piece are skipped."""

    def __init__(
        self,
        budget_s: float,
        out_path: Path | None = None,
        only: Sequence[str] = (),
        time_caps: dict[str, float] | None = None,
    ):
        self.started = time.monotonic()
        self.time_caps = dict(time_caps or {})  # seconds per stage name (before any "@")
        self.deadline = self.started + budget_s
        self.out_path = out_path
        self.only = tuple(only)
        self.capabilities: dict[str, Capability] = {}
        self.results: dict[str, str] = {}
        if out_path is not None:
            out_path.parent.mkdir(parents=True, exist_ok=True)
            out_path.write_text("")

    def emit(self, **fields: Any) -> None:
        line = json.dumps(fields, default=str)
        print(line, flush=True)
        if self.out_path is not None:
            with self.out_path.open("a") as f:
                f.write(line + "\n")

    def have(self, name: str, ok: bool, reason: str = "") -> None:
        """Record a capability; `reason` says why it is missing."""
        self.capabilities[name] = Capability(ok, reason)

    def missing(self, needs: Sequence[str]) -> list[str]:
        """ "name: reason" for each of `needs` that is missing or was never established."""
        out = []
        for name in needs:
            cap = self.capabilities.get(name, Capability(False, f"{name} was not established"))
            if not cap.ok:
                out.append(f"{name}: {cap.reason}")
        return out

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def stage(
        self,
        name: str,
        fn: Callable[[float], dict[str, Any] | None],
        *,
        needs: Sequence[str] = (),
        cap: float | None = None,
        always: bool = False,
    ) -> dict[str, Any] | None:
        """Run `fn(cap_seconds)` unless its needs are missing or time is up; emit its status line.

        With `only`, stages whose names start with none of its prefixes are left out silently, except
        `always` ones (what every other stage builds on)."""
        check = name
        base = name.split("@")[0]
        if self.only and not always and not any(name.startswith(o) for o in self.only):
            return None
        missing = self.missing(needs)
        if missing or self.left() < MIN_STAGE_S:
            reason = "; ".join(missing) or f"out of time ({self.left():.0f} s left)"
            self._done(check, "skipped", 0.0, {"reason": reason})
            return None
        cap_s = min(cap if cap is not None else self.time_caps.get(base, DEFAULT_CAP_S), self.left())
        t0 = time.monotonic()
        status, fields, result = "ok", {}, None
        try:
            with time_cap(cap_s):
                result = fn(cap_s) or {}
            fields = dict(result)
        except StageTimeout as exc:
            status, fields = "timeout", {"reason": str(exc)}
        except Skip as exc:
            status, fields = "skipped", {"reason": str(exc), **exc.fields}
        except CheckFailed as exc:
            status, fields = "failed", {"reason": str(exc), **exc.fields}
        except Exception as exc:
            status = "failed"
            fields = {
                "reason": f"{type(exc).__name__}: {exc}"[:2000],
                "traceback": tail(traceback.format_exc()),
            }
        finally:
            _release_memory()
        self._done(check, status, time.monotonic() - t0, fields)
        return result if status == "ok" else None

    def _done(self, check: str, status: str, seconds: float, fields: dict[str, Any]) -> None:
        self.results[check] = status
        head = {"check": check, "status": status, "seconds": round(seconds, 2)}
        self.emit(**head, **{k: v for k, v in fields.items() if k not in head})

    def summary(self) -> int:
        failed = [c for c, s in self.results.items() if s in ("failed", "timeout")]
        self.emit(
            check="summary",
            status="failed" if failed else "ok",
            seconds=round(time.monotonic() - self.started, 1),
            ok=[c for c, s in self.results.items() if s == "ok"],
            failed=failed,
            skipped=[c for c, s in self.results.items() if s == "skipped"],
        )
        return 1 if failed else 0


def tail(text: str, n: int = 1500) -> str:
    """The end of a long output (tracebacks, child logs), where the error is."""
    return text[-n:]


def _release_memory() -> None:
    gc.collect()
    torch = sys.modules.get("torch")  # a suite without torch has no device memory to hand back
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()
