"""Start RQ workers: one forking worker process per GPU (CUDA_VISIBLE_DEVICES pinned), plus a reconciler.

The processes started here never import torch or open a database connection: CUDA is initialised only
in the forked work horse, and a horse never inherits a connection pool from its parent. The reconciler
therefore runs as a sidecar process rather than a thread in the forking parent.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys

from peagle_core.processes import stop_process
from service.settings import Settings, get_settings
from worker.job_io import setup_logging

log = logging.getLogger(__name__)


def visible_gpus(requested: list[str] | None = None) -> list[str]:
    """GPU indices to run one worker on each: as requested, else CUDA_VISIBLE_DEVICES, else `nvidia-smi -L`
    (no torch import); [] on a machine without GPUs (one CPU worker then)."""
    if requested:
        return [g.strip() for item in requested for g in item.split(",") if g.strip()]
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [g for g in env.split(",") if g.strip()]
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20, check=True).stdout
    except (subprocess.SubprocessError, OSError):
        return []
    return [str(i) for i, line in enumerate(out.splitlines()) if line.startswith("GPU ")]


def group_gpus(gpus: list[str], per_worker: int) -> list[str]:
    """Split GPU indices into per-worker CUDA_VISIBLE_DEVICES values of `per_worker` GPUs each.

    A multi-GPU job (resources.gpus = N) needs a worker that sees N GPUs; leftover GPUs that do not
    fill a group are left idle rather than given a worker that would refuse such jobs.
    """
    if per_worker < 1:
        raise ValueError("gpus_per_worker must be >= 1")
    groups = [gpus[i : i + per_worker] for i in range(0, len(gpus), per_worker)]
    return [",".join(g) for g in groups if len(g) == per_worker]


SIDECAR_GRACE_S = 5.0  # how long the reconciler sidecar gets to exit on SIGTERM
# How long RQ's command listener (stop-job requests) waits per poll: also how long it takes to stop.
COMMAND_POLL_S = 1.0


def _peagle_worker_class() -> type:
    from rq import Worker

    from worker.monitor import PREEMPT_SIGNAL

    class PeagleWorker(Worker):
        """RQ's forking worker, plus: a warm shutdown asks the running job to checkpoint and requeue
        (instead of waiting hours for it to finish), and the command listener stops within a second."""

        def subscribe(self) -> None:
            # RQ's own listener waits up to 60 s per poll, and its shutdown joins the listener without a
            # timeout: when the UNSUBSCRIBE reply wakes the poll before the stop flag is set, the listener
            # polls again and the worker lingers 60 s after SIGTERM (measured: 1 shutdown in 6).
            self.log.info("Worker %s: subscribing to channel %s", self.name, self.pubsub_channel_name)
            self.pubsub = self.connection.pubsub()
            self.pubsub.subscribe(**{self.pubsub_channel_name: self.handle_payload})
            self.pubsub_thread = self.pubsub.run_in_thread(
                sleep_time=COMMAND_POLL_S, daemon=True, exception_handler=self._pubsub_exception_handler
            )

        def handle_warm_shutdown_request(self) -> None:
            super().handle_warm_shutdown_request()
            if self.horse_pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.horse_pid, PREEMPT_SIGNAL)

    return PeagleWorker


def run_worker(
    settings: Settings, queues: list[str], *, burst: bool = False, name: str | None = None
) -> bool:
    """Run one forking RQ worker in this process until stopped (or, with `burst`, until the queues are empty)."""
    from service.queue import redis_from_url

    # Blocking dequeues outlive a short socket timeout.
    redis = redis_from_url(settings.redis_url, socket_timeout=None)
    worker = _peagle_worker_class()(
        queues, connection=redis, name=name or f"{socket.gethostname()}.{os.getpid()}"
    )
    return worker.work(burst=burst, logging_level="INFO", with_scheduler=False)


def _child(args: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "worker.pool", *args], env=env)


def run_pool(
    settings: Settings, queues: list[str], *, gpus: list[str], burst: bool = False, reconcile: bool = True
) -> int:
    """One worker per entry of `gpus` (a CUDA_VISIBLE_DEVICES value such as "0" or "0,1"; one CPU worker
    when empty) and, unless `burst`, a reconciler sidecar."""
    env = dict(os.environ)
    sidecar = _child(["reconcile"], env) if reconcile and not burst else None
    try:
        if len(gpus) <= 1:
            if gpus:
                os.environ["CUDA_VISIBLE_DEVICES"] = gpus[0]
            run_worker(settings, queues, burst=burst)
            return 0
        host = socket.gethostname()
        children = []
        for gpu in gpus:
            child_env = {**env, "CUDA_VISIBLE_DEVICES": gpu}
            name = f"{host}.{os.getpid()}.gpu{gpu.replace(',', '-')}"
            children.append(
                _child(["rq", "--name", name, *(["--burst"] if burst else []), *queues], child_env)
            )

        def forward(signum: int, _frame: object) -> None:
            for c in children:
                if c.poll() is None:
                    c.send_signal(signum)

        signal.signal(signal.SIGTERM, forward)
        signal.signal(signal.SIGINT, forward)
        codes = [c.wait() for c in children]
        return max(codes, default=0)
    finally:
        if sidecar is not None:
            # Killed if it has not exited in time (a reconcile pass stuck on the database): the pool's
            # own stop stays bounded and leaves nothing behind.
            stop_process(sidecar, grace_s=SIDECAR_GRACE_S)


def main(argv: list[str] | None = None) -> int:
    """`python -m worker.pool rq [--burst] [--name N] QUEUE...` or `... reconcile`: the pool's children."""
    parser = argparse.ArgumentParser(prog="python -m worker.pool")
    sub = parser.add_subparsers(dest="cmd", required=True)
    rq_cmd = sub.add_parser("rq")
    rq_cmd.add_argument("queues", nargs="+")
    rq_cmd.add_argument("--name")
    rq_cmd.add_argument("--burst", action="store_true")
    sub.add_parser("reconcile")
    args = parser.parse_args(argv)
    setup_logging()
    settings = get_settings()
    if args.cmd == "rq":
        run_worker(settings, args.queues, burst=args.burst, name=args.name)
        return 0
    from worker.reconcile import reconcile_loop

    stop_on_term()
    reconcile_loop(settings)
    return 0


def stop_on_term() -> None:
    """Exit quietly on SIGTERM (the pool stops its sidecar that way)."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))


if __name__ == "__main__":
    sys.exit(main())
