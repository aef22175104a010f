"""What the dashboard's templates show: the Jinja2 environment, display filters, and the view models built
from rows (job list rows, checkpoint cards, the stage timeline)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from fastapi import Request
from fastapi.responses import HTMLResponse
from fastapi.templating import Jinja2Templates

from peagle_core.figures import Acceptance, k_key
from peagle_core.serving.command import serve_command
from peagle_core.serving.recommendation import ServingRecommendation
from peagle_core.serving.report import EvaluationReport
from peagle_core.serving.speedup import Speedup
from service.db.models import Checkpoint, Job, JobEvent, Project, utcnow
from service.ui.session import CSRF_FIELD, UiSession, save_session

HERE = Path(__file__).parent
templates = Jinja2Templates(directory=str(HERE / "templates"))

# Everything is served by this app: no CDN, no inline script (page data travels as JSON in <script
# type="application/json">, which is not executed). Plotly sets inline styles on its SVG.
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
    "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'"
)

# Status is never shown by colour alone: each has a symbol and its word.
STATUS_SYMBOLS = {
    "queued": "◷",
    "running": "▶",
    "cancelling": "◼",
    "succeeded": "✔",
    "failed": "✖",
    "cancelled": "⊘",
}


def age(value: datetime | None, now: datetime | None = None) -> str:
    """`value` as "12 s ago", "5 min ago", "3 h ago", "2 d ago"."""
    if value is None:
        return "—"
    seconds = max(0, int(((now or utcnow()) - value).total_seconds()))
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds // size} {unit} ago"
    return f"{seconds} s ago"


def elapsed_text(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "—"
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600} h {seconds % 3600 // 60} min"
    if seconds >= 60:
        return f"{seconds // 60} min {seconds % 60} s"
    return f"{seconds} s"


def size(n: int | None) -> str:
    if n is None:
        return "—"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


templates.env.filters.update(age=age, duration=elapsed_text, size=size)
templates.env.globals.update(STATUS_SYMBOLS=STATUS_SYMBOLS, CSRF_FIELD=CSRF_FIELD)


def render_page(
    request: Request,
    name: str,
    session: UiSession,
    project: Project | None = None,
    status_code: int = 200,
    **context: Any,
) -> HTMLResponse:
    """A page (or fragment) with the session's CSRF token; sets the cookie when the session is new.

    A form shown again with its errors answers 200, as HTML forms do: a 4xx document is a console error
    in the browser, and the errors are in the page (role="alert", aria-invalid) rather than the status.
    """
    response = templates.TemplateResponse(
        request,
        name,
        {"csrf": session.csrf, "project": project, "nav": context.pop("nav", None), **context},
        status_code=status_code,
    )
    response.headers["Content-Security-Policy"] = CSP
    response.headers["Cache-Control"] = "no-store"
    if session.fresh:
        save_session(request, response, session)
    return response


def _eval(ckpt: Checkpoint) -> EvaluationReport:
    return EvaluationReport.from_dict((ckpt.metrics or {}).get("eval"))


def checkpoint_acceptance(ckpt: Checkpoint) -> dict[str, float]:
    """{"k=4": 2.1, ...}: our evaluation's acceptance length per K, from the checkpoint's eval.json."""
    return {
        k_key(k): float(r.ours.acceptance_length)
        for k, r in _eval(ckpt).results.items()
        if r.ours is not None and r.ours.acceptance_length is not None
    }


def _vllm_figures(ckpt: Checkpoint) -> dict[str, Acceptance]:
    """vLLM's figures per K where it measured them: its spec-decode counters during our evaluation
    (`evaluation.engine`), else the publish check's run on the published files."""
    report = _eval(ckpt)
    out = {
        k_key(k): r.vllm
        for k, r in report.results.items()
        if r.vllm is not None and r.vllm.acceptance_length is not None
    }
    serving = report.serving
    measured = serving is not None and serving.acceptance_length is not None
    if not out and measured and serving.k is not None:
        out[k_key(serving.k)] = serving.acceptance
    return out


def _float(value: float | None) -> float | None:
    return float(value) if value is not None else None


def vllm_acceptance(ckpt: Checkpoint) -> dict[str, float]:
    """vLLM's acceptance length per K where it was measured."""
    return {k: float(fig.acceptance_length or 0.0) for k, fig in _vllm_figures(ckpt).items()}


@dataclass
class PositionRow:
    k: str
    position: int  # 1-based: the share of drafts whose first `position` tokens were all accepted
    ours: float | None
    vllm: float | None


def acceptance_by_position(ckpt: Checkpoint) -> list[PositionRow]:
    """Per K and draft position: our acceptance rate and vLLM's, where each was measured."""
    ours = {k_key(k): r.ours.rates if r.ours else [] for k, r in _eval(ckpt).results.items()}
    theirs = {k: fig.rates for k, fig in _vllm_figures(ckpt).items()}
    rows = []
    for k in dict.fromkeys([*ours, *theirs]):
        a, b = ours.get(k, []), theirs.get(k, [])
        for j in range(max(len(a), len(b))):
            rows.append(PositionRow(k, j + 1, a[j] if j < len(a) else None, b[j] if j < len(b) else None))
    return rows


@dataclass
class CategoryRow:
    k: str
    category: str
    prompts: int | None
    ours: float | None
    vllm: float | None


def acceptance_by_category(ckpt: Checkpoint) -> list[CategoryRow]:
    """Per K and prompt category (where the evaluation prompts carry one): ours and vLLM's acceptance."""

    def per_category(fig: Acceptance | None) -> dict[str, Acceptance]:
        return dict(fig.categories or {}) if fig is not None else {}

    def length(fig: Acceptance | None) -> float | None:
        return _float(fig.acceptance_length) if fig is not None else None

    ours = {k_key(k): per_category(r.ours) for k, r in _eval(ckpt).results.items()}
    theirs = {k: per_category(fig) for k, fig in _vllm_figures(ckpt).items()}
    rows = []
    for k in dict.fromkeys([*ours, *theirs]):
        a, b = ours.get(k, {}), theirs.get(k, {})
        for cat in dict.fromkeys([*a, *b]):
            first = a.get(cat) or b.get(cat)
            n = first.num_prompts if first is not None else None
            rows.append(CategoryRow(k, cat, n, length(a.get(cat)), length(b.get(cat))))
    return rows


def vllm_speedup(ckpt: Checkpoint) -> Speedup | None:
    """vLLM's measured speed-up (`evaluation.measure_speedup`), recorded by the publish check (None
    where it lacks a figure the page shows)."""
    serving = _eval(ckpt).serving
    m = serving.speedup if serving is not None else None
    shown = (m.output_tokens_per_s, m.baseline_output_tokens_per_s, m.speedup) if m is not None else (None,)
    return m if all(v is not None for v in shown) else None


def vllm_speedups(ckpt: Checkpoint) -> list[Speedup]:
    """Every speed-up the publish check measured, per speculator, K and batch size (none before there
    were several)."""
    serving = _eval(ckpt).serving
    rows = (serving.speedups if serving is not None else None) or []
    return [r for r in rows if r.speedup is not None and r.k is not None and r.batch_size is not None]


def serving_recommendation(ckpt: Checkpoint) -> ServingRecommendation | None:
    """How to serve it, drawn from those speed-ups (None when they were not measured)."""
    serving = _eval(ckpt).serving
    return serving.recommendation if serving is not None else None


@dataclass
class JobRow:
    job: Job
    best_acceptance: float | None

    @property
    def percent(self) -> int | None:
        p = self.job.progress or {}
        step, total = p.get("step"), p.get("total_steps")
        if self.job.status == "succeeded":
            return 100
        if isinstance(step, int) and isinstance(total, int) and total > 0:
            return min(100, round(100 * step / total))
        return None


def job_rows(jobs: list[Job], checkpoints: list[Checkpoint]) -> list[JobRow]:
    """List rows with each job's best acceptance length: its checkpoints' evaluation, else the best
    evaluation a running job has reported so far."""
    best: dict[str, float] = {}
    for ckpt in checkpoints:
        for value in checkpoint_acceptance(ckpt).values():
            best[ckpt.job_id] = max(value, best.get(ckpt.job_id, 0.0))
    rows = []
    for job in jobs:
        value = best.get(job.id)
        if value is None and isinstance((job.progress or {}).get("acceptance_length"), int | float):
            value = float(job.progress["acceptance_length"])
        rows.append(JobRow(job, value))
    return rows


@dataclass
class CheckpointCard:
    ckpt: Checkpoint
    acceptance: dict[str, float]
    vllm: dict[str, float]
    command: str
    positions: list[PositionRow]
    categories: list[CategoryRow]
    speedup: Speedup | None
    speedups: list[Speedup]
    recommendation: ServingRecommendation | None


def checkpoint_cards(job: Job, checkpoints: list[Checkpoint]) -> list[CheckpointCard]:
    spec = job.spec
    ks = (spec.get("evaluation") or {}).get("speculative_tokens") or [
        (spec.get("model") or {}).get("num_depths", 4)
    ]
    verifier = (spec.get("verifier") or {}).get("name_or_path", "VERIFIER")
    method = (spec.get("model") or {}).get("method", "peagle")  # EAGLE-3 is served without parallel drafting
    cards = []
    for c in checkpoints:
        recommendation = serving_recommendation(c)
        k = recommendation.serve_k(max(ks)) if recommendation is not None else max(ks)
        cards.append(
            CheckpointCard(
                ckpt=c,
                acceptance=checkpoint_acceptance(c),
                vllm=vllm_acceptance(c),
                # The archive unpacks into a directory named after the checkpoint.
                command=serve_command(verifier, f"./{c.id}", k, method=method),
                positions=acceptance_by_position(c),
                categories=acceptance_by_category(c),
                speedup=vllm_speedup(c),
                speedups=vllm_speedups(c),
                recommendation=recommendation,
            )
        )
    return cards


@dataclass
class Stage:
    name: str
    started: datetime
    seconds: float | None  # None while it is the current stage of a running job


def timeline(job: Job, events: list[JobEvent]) -> list[Stage]:
    """The job's stages in order with how long each took (the last one ends when the job did)."""
    marks: list[tuple[str, datetime]] = []
    for e in events:
        # A stage announced again while current (a retried step of the same stage) is no new stage.
        if e.type == "stage" and e.data and (not marks or marks[-1][0] != e.data.get("stage")):
            marks.append((str(e.data.get("stage")), e.created_at))
    stages = []
    for i, (name, start) in enumerate(marks):
        end = marks[i + 1][1] if i + 1 < len(marks) else job.finished_at
        stages.append(Stage(name, start, (end - start).total_seconds() if end else None))
    return stages
