"""The worker side of `peagle`: `worker` (the RQ pool) and `reconcile`."""

from __future__ import annotations

from typing import Annotated

import typer

from peagle_core.torch_builds import require_matching_companions


def worker(
    queue: Annotated[
        list[str] | None,
        typer.Option("--queue", "-q", help="Queue to listen on (repeatable).", show_default="default"),
    ] = None,
    gpu: Annotated[
        list[str] | None,
        typer.Option(
            help="GPU index to run a worker on (repeatable or comma-separated); default: one worker per "
            "visible GPU, or a single CPU worker without GPUs.",
        ),
    ] = None,
    gpus_per_worker: Annotated[
        int,
        typer.Option(
            min=1,
            help="GPUs each worker sees; use N for a queue of jobs with resources.gpus = N (trained under "
            "torchrun inside the job).",
        ),
    ] = 1,
    burst: Annotated[bool, typer.Option("--burst", help="Exit once the queues are empty.")] = False,
    reconcile: Annotated[
        bool, typer.Option(help="Run the crash-recovery reconciler beside the workers.")
    ] = True,
) -> None:
    """Run RQ GPU workers that execute training jobs."""
    from service.settings import get_settings
    from worker.job_io import setup_logging
    from worker.pool import group_gpus, run_pool, visible_gpus

    setup_logging()
    require_matching_companions()
    gpus = visible_gpus(gpu)
    groups = group_gpus(gpus, gpus_per_worker) if gpus else []
    if gpus and not groups:
        raise typer.BadParameter(
            f"{len(gpus)} GPU(s) visible, fewer than --gpus-per-worker {gpus_per_worker}",
            param_hint="--gpus-per-worker",
        )
    code = run_pool(get_settings(), queue or ["default"], gpus=groups, burst=burst, reconcile=reconcile)
    raise typer.Exit(code)


def reconcile(
    loop: Annotated[
        bool, typer.Option("--loop", help="Keep reconciling every reconcile_interval_s.")
    ] = False,
) -> None:
    """Repair jobs whose worker died, re-enqueue jobs Redis lost, and hard-stop overdue cancels."""
    from service.settings import get_settings
    from worker.job_io import setup_logging
    from worker.reconcile import reconcile_loop, reconcile_once

    setup_logging()
    settings = get_settings()
    if loop:
        reconcile_loop(settings)
        return
    report = reconcile_once(settings, min_queued_age_s=0.0)
    typer.echo(
        f"requeued {len(report.requeued)}, failed {len(report.failed)}, re-enqueued "
        f"{len(report.reenqueued)}, cancelled {len(report.cancelled)}, hard-stopped {len(report.hard_stopped)}"
    )


def register(app: typer.Typer) -> None:
    """Add the worker commands to `app`."""
    app.command("worker")(worker)
    app.command("reconcile")(reconcile)
