"""`peagle worker` and `peagle reconcile`."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Add the worker commands to `app`."""

    @app.command("worker")
    def worker_cmd(
        queue: list[str] = typer.Option(
            ["default"], "--queue", "-q", help="Queue to listen on (repeatable)."
        ),
        gpu: list[str] = typer.Option(
            None,
            "--gpu",
            help="GPU index to run a worker on (repeatable or comma-separated); default: one worker per "
            "visible GPU, or a single CPU worker without GPUs.",
        ),
        gpus_per_worker: int = typer.Option(
            1,
            "--gpus-per-worker",
            min=1,
            help="GPUs each worker sees; use N for a queue of jobs with resources.gpus = N (trained under "
            "torchrun inside the job).",
        ),
        burst: bool = typer.Option(False, "--burst", help="Exit once the queues are empty."),
        reconcile: bool = typer.Option(
            True, "--reconcile/--no-reconcile", help="Run the crash-recovery reconciler beside the workers."
        ),
    ) -> None:
        """Run RQ GPU workers that execute training jobs."""
        import logging

        from service.settings import get_settings
        from worker.main import group_gpus, run_pool, visible_gpus

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        gpus = visible_gpus(gpu)
        groups = group_gpus(gpus, gpus_per_worker) if gpus else []
        if gpus and not groups:
            raise typer.BadParameter(
                f"{len(gpus)} GPU(s) visible, fewer than --gpus-per-worker {gpus_per_worker}",
                param_hint="--gpus-per-worker",
            )
        code = run_pool(get_settings(), queue, gpus=groups, burst=burst, reconcile=reconcile)
        raise typer.Exit(code)

    @app.command("reconcile")
    def reconcile_cmd(
        loop: bool = typer.Option(False, "--loop", help="Keep reconciling every reconcile_interval_s."),
    ) -> None:
        """Repair jobs whose worker died, re-enqueue jobs Redis lost, and hard-stop overdue cancels."""
        import logging

        from service.settings import get_settings
        from worker.reconcile import reconcile_loop, reconcile_once

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        settings = get_settings()
        if loop:
            reconcile_loop(settings)
            return
        report = reconcile_once(settings, min_queued_age_s=0.0)
        typer.echo(
            f"requeued {len(report.requeued)}, failed {len(report.failed)}, re-enqueued "
            f"{len(report.reenqueued)}, cancelled {len(report.cancelled)}, hard-stopped {len(report.hard_stopped)}"
        )
