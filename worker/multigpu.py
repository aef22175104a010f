"""Multi-GPU jobs: the work horse runs training under torchrun, one rank per local GPU (gloo on CPU).

Ranks are separate processes, so they talk to the database themselves: every rank polls the stop check
(the trainer agrees on it across ranks), rank 0 writes metrics and events, and rank 0 hands the result
back to the horse in a JSON file. The horse's own monitor keeps the job's heartbeat.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from peagle_core.errors import PeagleError
from peagle_core.io import atomic_write_json
from peagle_core.spec import JobSpec
from service.settings import Settings
from worker.runner import STAGES, Outcome

log = logging.getLogger(__name__)


def train_distributed(
    settings: Settings,
    job_id: str,
    spec: JobSpec,
    out_dir: Path,
    dataset_dir: Path,
    cache_dir: Path | None,
    *,
    attempt: int,
    worker_name: str,
) -> Outcome:
    """Run `peagle_core.train.train` on `spec.resources.gpus` local ranks and return rank 0's outcome."""
    result_path = out_dir / f"result-attempt{attempt}.json"
    result_path.unlink(missing_ok=True)
    env = {
        **os.environ,
        "PEAGLE_DATABASE_URL": settings.database_url,
        "PEAGLE_ARTIFACT_ROOT": settings.artifact_root,
        "PEAGLE_REDIS_URL": settings.redis_url,
    }
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={spec.resources.gpus}",
        "-m", "worker.multigpu",
        "--job-id", job_id, "--out-dir", str(out_dir), "--dataset-dir", str(dataset_dir),
        "--attempt", str(attempt), "--worker-name", worker_name, "--result", str(result_path),
    ]  # fmt: skip
    if cache_dir is not None:
        cmd += ["--cache-dir", str(cache_dir)]
    proc = subprocess.run(cmd, env=env, check=False)
    if not result_path.is_file():
        raise RuntimeError(f"torchrun exited with status {proc.returncode} without a result")
    result = json.loads(result_path.read_text())
    if "error" in result:
        raise PeagleError(result["error"]["message"], code=result["error"]["code"])
    return Outcome(**result)


def _rank_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    for name in ("--job-id", "--out-dir", "--dataset-dir", "--worker-name", "--result"):
        parser.add_argument(name, required=True)
    parser.add_argument("--cache-dir")
    parser.add_argument("--attempt", type=int, required=True)
    args = parser.parse_args(argv)

    from sqlalchemy import select

    from peagle_core.train import train
    from service.db.models import Job
    from service.db.session import session_factory
    from service.settings import get_settings
    from worker.cancel import JobMonitor
    from worker.progress import ProgressWriter
    from worker.runner import add_event

    rank = int(os.environ.get("RANK", "0"))
    sessions = session_factory(get_settings().database_url)
    with sessions() as session:
        spec = JobSpec.model_validate(
            session.execute(select(Job.spec).where(Job.id == args.job_id)).scalar_one()
        )
    monitor = JobMonitor(sessions, args.job_id, args.worker_name, heartbeat_s=float("inf")).start()
    progress = ProgressWriter(sessions, args.job_id, attempt=args.attempt) if rank == 0 else None

    def on_event(kind: str, message: str, data: dict[str, Any] | None = None) -> None:
        if rank == 0:
            with sessions() as session:
                add_event(
                    session,
                    args.job_id,
                    "stage" if kind in STAGES else "log",
                    message,
                    {"stage": kind, **(data or {})},
                )
                session.commit()

    try:
        result = train(
            spec,
            Path(args.out_dir),
            on_metrics=progress.on_metrics if progress else None,
            should_stop=monitor.should_stop,
            on_event=on_event,
            resume=True,
            dataset_dir=Path(args.dataset_dir),
            cache_dir=Path(args.cache_dir) if args.cache_dir else None,
        )
        if progress:
            progress.flush()
    except PeagleError as exc:
        if rank == 0:
            atomic_write_json(args.result, {"error": {"code": exc.code, "message": exc.message}})
        return 1
    finally:
        monitor.stop()
    if rank == 0:
        atomic_write_json(
            args.result,
            {
                "status": result.status,
                "step": int(result.step),
                "export_dir": str(result.export_dir) if result.export_dir else None,
                "checkpoint_dir": str(result.checkpoint_dir) if result.checkpoint_dir else None,
                "metrics": json.loads(json.dumps(result.metrics or {}, default=float)),
            },
        )
    return 0


if __name__ == "__main__":
    sys.exit(_rank_main())
