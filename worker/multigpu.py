"""Multi-GPU jobs: the work horse runs training under torchrun, one rank per local GPU (gloo on CPU).

Ranks are separate processes, so they talk to the database themselves: every rank polls the stop check
(the trainer agrees on it across ranks), rank 0 writes metrics and events, and rank 0 hands the result
back to the horse in a JSON file. The horse's own monitor keeps the job's heartbeat. A drain reaches the
horse as PREEMPT_SIGNAL; the horse forwards it to every rank (each announces its pid in a file once its
handler is installed, so no rank is killed by a signal it cannot handle yet), the ranks agree to stop, and
rank 0 saves a checkpoint before it reports, exactly as a single-process job does.

A job across machines (`worker.gang`) runs the same ranks under a torchrun that joins the job's c10d
rendezvous instead of `--standalone`; the ranks then renumber themselves so that the leader's come first
(`leader_first`), and rank 0, which reports, runs beside the worker that publishes.

A job asking for more GPUs than the worker sees fails with `insufficient_gpus`. On a machine without
GPUs, `PEAGLE_ALLOW_CPU_MULTIPROCESS=1` runs the ranks as CPU processes over gloo instead (for tests and
development; it is never what a real job wants).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from peagle_core.errors import PeagleError
from peagle_core.io import atomic_write_json
from peagle_core.pipeline.stages import PipelineResult
from peagle_core.processes import exit_now, stop_process
from peagle_core.spec import JobSpec, load_spec
from service.settings import Settings
from worker.attempt import AttemptContext
from worker.job_io import JobReporter, error_for, setup_logging, write_event
from worker.monitor import PREEMPT_SIGNAL
from worker.rendezvous import Rendezvous

log = logging.getLogger(__name__)


ALLOW_CPU_ENV = "PEAGLE_ALLOW_CPU_MULTIPROCESS"
ABANDON_GRACE_S = (
    15.0  # how long ranks whose job moved on get to stop by themselves before torchrun is stopped
)
# How long the ranks get to exit once rank 0 has written its result: a rank that finished its work but hangs
# in teardown would otherwise keep torchrun, and the job, waiting for ever.
RANK_EXIT_GRACE_S = 60.0


def rank_device(gpus: int) -> str:
    """ "cuda" or "cpu": where `gpus` ranks of this job run on this worker, or `insufficient_gpus`."""
    import torch

    visible = torch.cuda.device_count()
    if gpus <= 1 or visible >= gpus:
        return "cuda" if visible else "cpu"
    if visible == 0 and os.environ.get(ALLOW_CPU_ENV) == "1":
        return "cpu"
    where = os.environ.get("CUDA_VISIBLE_DEVICES")
    pinned = f" (CUDA_VISIBLE_DEVICES={where})" if where is not None else ""
    raise PeagleError(
        f"resources.gpus={gpus} but this worker sees {visible} GPU(s){pinned}; submit to a queue served by "
        f"a worker with {gpus} GPUs",
        code="insufficient_gpus",
        param="resources.gpus",
    )


@dataclass(frozen=True)
class RankLaunch:
    """What every machine's ranks of one attempt train on: the job, its checked spec and this machine's
    directories (`cache_dir` None: the spec's own)."""

    settings: Settings
    job_id: str
    spec: JobSpec
    out_dir: Path
    dataset_dir: Path
    cache_dir: Path | None
    attempt: int
    worker_name: str


def train_distributed(
    launch: RankLaunch,
    *,
    preempted: threading.Event | None = None,
    rendezvous: Rendezvous | None = None,
) -> PipelineResult:
    """The pipeline's training stage on `spec.resources.gpus` local ranks (and, with `rendezvous`, on the
    other machines that join it); returns rank 0's result, which runs here.

    The ranks read the horse's checked spec as its user wrote it (unset fields stay unset). Once
    `preempted` is set (the horse's PREEMPT_SIGNAL handler), the signal is forwarded to every rank."""
    result_path = launch.out_dir / f"result-attempt{launch.attempt}.json"
    result_path.unlink(missing_ok=True)
    code = run_ranks(launch, result_path=result_path, preempted=preempted, rendezvous=rendezvous, leader=True)
    if not result_path.is_file():
        raise PeagleError(
            f"a training rank exited (torchrun status {code}) before rank 0 reported a result; "
            "see the worker log",
            code="rank_failed",
        )
    result = json.loads(result_path.read_text())
    if "error" in result:
        error = result["error"]
        raise PeagleError(error["message"], code=error["code"], param=error.get("param"))
    return PipelineResult.from_dict(result)


def ranks_started(out_dir: Path, attempt: int) -> bool:
    """Whether any rank of this attempt got past its start-up (with a rendezvous: the gang formed)."""
    return any((out_dir / f"ranks-attempt{attempt}").glob("rank-*.pid"))


def run_ranks(
    launch: RankLaunch,
    *,
    result_path: Path,
    preempted: threading.Event | None = None,
    rendezvous: Rendezvous | None = None,
    leader: bool = True,
    abort: threading.Event | None = None,
    node: int = 0,
) -> int:
    """Run this machine's ranks under torchrun until they exit; returns torchrun's status.

    Without `rendezvous` torchrun is standalone (one machine); with it, this machine is one node of the
    gang (`leader`: it hosts the store and its ranks come first). `abort` set (the job is no longer this
    attempt's): torchrun is stopped unless its ranks end within ABANDON_GRACE_S. `node` tells apart the files of machines sharing `out_dir`."""
    out_dir, attempt = launch.out_dir, launch.attempt
    suffix = f"-node{node}" if node else ""
    spec_path = out_dir / f"spec-attempt{attempt}{suffix}.json"
    atomic_write_json(spec_path, launch.spec.model_dump(mode="json", exclude_unset=True))
    pid_dir = out_dir / f"ranks-attempt{attempt}{suffix}"
    shutil.rmtree(pid_dir, ignore_errors=True)
    pid_dir.mkdir(parents=True)
    if rendezvous is None:
        rdzv = ["--standalone"]
    else:
        rdzv = rendezvous.torchrun_args(is_host=leader, local_addr=launch.settings.worker_address)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", *rdzv,
        f"--nproc-per-node={launch.spec.resources.gpus}",
        "-m", "worker.multigpu",
        "--job-id", launch.job_id, "--spec", str(spec_path), "--out-dir", str(out_dir),
        "--dataset-dir", str(launch.dataset_dir), "--attempt", str(attempt), "--worker-name", launch.worker_name,
        "--result", str(result_path),
        "--pid-dir", str(pid_dir),
    ]  # fmt: skip
    if launch.cache_dir is not None:
        cmd += ["--cache-dir", str(launch.cache_dir)]
    if rendezvous is not None and leader:
        cmd += ["--leader"]
    proc = subprocess.Popen(cmd, env=_rank_env(launch.settings, launch.spec))
    try:
        _supervise(proc, launch, result_path, pid_dir, preempted, abort)
    except BaseException:
        # The horse itself is going (a timeout, an interrupt) or the job was taken from this attempt:
        # torchrun stops its ranks on SIGTERM.
        stop_process(proc, grace_s=30)
        raise
    return proc.returncode


def _rank_env(settings: Settings, spec: JobSpec) -> dict[str, str]:
    env = {
        **os.environ,
        "PEAGLE_DATABASE_URL": settings.database_url,
        "PEAGLE_ARTIFACT_ROOT": settings.artifact_root,
        "PEAGLE_REDIS_URL": settings.redis_url,
    }
    if rank_device(spec.resources.gpus) == "cpu":
        # CPU ranks share the cores: one intra-op thread each avoids oversubscription.
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _supervise(
    proc: subprocess.Popen[bytes],
    launch: RankLaunch,
    result_path: Path,
    pid_dir: Path,
    preempted: threading.Event | None,
    abort: threading.Event | None,
) -> None:
    """Wait for torchrun to exit, forwarding a drain's signal to the ranks; stop it once its ranks outstay
    RANK_EXIT_GRACE_S past rank 0's result, or ABANDON_GRACE_S past `abort` (then raise JobAbandoned)."""
    signalled: set[int] = set()
    finished_at: float | None = None
    while proc.poll() is None:
        if finished_at is None and result_path.is_file():
            finished_at = time.monotonic()
        if finished_at is not None and time.monotonic() - finished_at > RANK_EXIT_GRACE_S:
            log.warning(
                "job %s attempt %d: ranks still running %.0f s after rank 0's result; stopping torchrun",
                launch.job_id, launch.attempt, RANK_EXIT_GRACE_S,
            )  # fmt: skip
            stop_process(proc, grace_s=10)
            return
        if abort is not None and abort.is_set():
            # The ranks see it too and stop on their own (a job that just finished ends this way).
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=ABANDON_GRACE_S)
                return
            raise JobAbandoned
        if preempted is not None and preempted.is_set():
            # Again each round: a rank that announced itself since the last round is told too.
            signalled |= forward_signal(pid_dir, PREEMPT_SIGNAL, skip=signalled)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=0.5)


class JobAbandoned(Exception):
    """Raised by `run_ranks` once its `abort` event is set (after stopping torchrun)."""


def forward_signal(pid_dir: Path, signum: int, *, skip: set[int]) -> set[int]:
    """Send `signum` to every rank that announced its pid in `pid_dir` (but those in `skip`); returns the
    pids signalled."""
    sent = set()
    for path in pid_dir.glob("rank-*.pid"):
        try:
            pid = int(path.read_text())
        except (OSError, ValueError):
            continue  # being written (it is renamed into place): the next round reads it
        if pid in skip:
            continue
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)
            log.info("forwarded signal %d to rank pid %d", signum, pid)
        sent.add(pid)
    return sent


def listen_for_preemption(preempted: threading.Event) -> None:
    """Set `preempted` when PREEMPT_SIGNAL arrives, without it ever interrupting another thread.

    Call first thing in a rank, before any thread exists: the signal is blocked in this thread, so every
    thread started later (gloo's, the data loader's) inherits the block and none of their blocking calls
    is cut short by it (a gloo thread interrupted mid-receive can hang the group's teardown); one thread
    takes it with sigwait. A thread that existed before still gets the Python handler, never the default
    action (which would kill the rank)."""
    signal.signal(PREEMPT_SIGNAL, lambda *_: preempted.set())
    signal.pthread_sigmask(signal.SIG_BLOCK, {PREEMPT_SIGNAL})

    def wait() -> None:
        while True:
            signal.sigwait({PREEMPT_SIGNAL})
            preempted.set()

    threading.Thread(target=wait, name="preempt-signal", daemon=True).start()


def leader_first_rank(rank: int, per_node: int, leader_node: int) -> tuple[int, int]:
    """(rank, node) of torchrun's `rank` once the leader's machine and the first one swap places."""
    node = rank // per_node
    node = 0 if node == leader_node else leader_node if node == 0 else node
    return node * per_node + rank % per_node, node


def leader_first(is_leader: bool) -> None:
    """Across machines, renumber the ranks so the leader machine's come first, then join the process group.

    torchrun orders machines by its own key (address, pid), but rank 0 must run beside the job's leader:
    it writes the result, the checkpoints the leader's mirror uploads and the export the leader publishes.
    One exchange over a throwaway gloo group finds the leader's machine, which swaps places with the
    first one; the real group then forms under a store prefix no earlier round can have used. No-op on
    one machine."""
    import uuid
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    if int(os.environ.get("GROUP_WORLD_SIZE", "1")) <= 1:
        return
    dist.init_process_group("gloo")
    everyone: list[tuple[bool, str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (is_leader, uuid.uuid4().hex))
    dist.destroy_process_group()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    leaders = {r // per_node for r, entry in enumerate(everyone) if entry is not None and entry[0]}
    if len(leaders) != 1:
        raise PeagleError(f"the ranks found {len(leaders)} leader machines, not one", code="gang_incomplete")
    (lead,) = leaders
    rank, node = leader_first_rank(rank, per_node, lead)
    os.environ["RANK"], os.environ["GROUP_RANK"] = str(rank), str(node)
    assert everyone[0] is not None
    store = dist.PrefixStore(
        f"peagle/{everyone[0][1]}",
        dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
            timeout=timedelta(minutes=10),
        ),
    )  # fmt: skip
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend, store=store, rank=rank, world_size=world)


def _announce(pid_dir: Path, rank: int) -> None:
    tmp = pid_dir / f".rank-{rank}.tmp"
    tmp.write_text(str(os.getpid()))
    tmp.rename(pid_dir / f"rank-{rank}.pid")


def _rank_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    for name in (
        "--job-id",
        "--spec",
        "--out-dir",
        "--dataset-dir",
        "--worker-name",
        "--result",
        "--pid-dir",
    ):
        parser.add_argument(name, required=True)
    parser.add_argument("--cache-dir")
    parser.add_argument("--attempt", type=int, required=True)
    parser.add_argument("--leader", action="store_true", help="this machine leads a multi-node job")
    return parser.parse_args(argv)


def _rank_main(argv: list[str] | None = None) -> int:
    args = _rank_args(argv)
    # Before the imports below start any thread (torch, the database pool); announced once the trainer can
    # act on it.
    preempted = threading.Event()
    listen_for_preemption(preempted)

    from service.db.session import session_factory
    from service.settings import get_settings
    from worker.monitor import JobMonitor
    from worker.progress import ProgressWriter

    leader_first(args.leader)
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    settings = get_settings()
    sessions = session_factory(settings.database_url)

    spec = load_spec(args.spec)
    write_event(
        sessions,
        args.job_id,
        args.attempt,
        "log",
        f"rank {rank} of {world_size} started",
        {"kind": "rank", "rank": rank, "world_size": world_size, "pid": os.getpid()},
    )
    ctx = AttemptContext(sessions, args.job_id, args.attempt)
    monitor = JobMonitor(ctx, heartbeat_s=float("inf"))
    # The horse forwards a drain's signal: stop at the next step with a checkpoint, like the horse would.
    monitor.preempted = preempted
    monitor.start()
    _announce(Path(args.pid_dir), rank)
    # Only rank 0 reports: one set of metric rows, progress and events per job.
    progress = ProgressWriter(ctx).start() if rank == 0 else None
    reporter = JobReporter(progress, on_stage=progress.set_stage) if progress else None
    try:
        return _train_rank(args, spec, rank, reporter, monitor.should_stop)
    finally:
        if progress is not None:
            progress.close(tolerance_s=settings.db_outage_tolerance_s)
        monitor.stop()


def _train_rank(
    args: argparse.Namespace,
    spec: JobSpec,
    rank: int,
    reporter: JobReporter | None,
    should_stop: Callable[[], bool],
) -> int:
    """Train this rank's share; rank 0 writes the result (or the error) for the horse. Returns the exit code."""
    from peagle_core.training.loop import train

    try:
        result = train(
            spec,
            Path(args.out_dir),
            reporter=reporter,
            should_stop=should_stop,
            resume=True,
            dataset_dir=Path(args.dataset_dir),
            cache_dir=Path(args.cache_dir) if args.cache_dir else None,
        )
    except Exception as exc:
        log.exception("rank %d failed", rank)
        if rank == 0:
            atomic_write_json(args.result, {"error": error_for(exc, stage="train")})
        return 1
    if rank == 0:
        atomic_write_json(args.result, result.to_dict())
    return 0


if __name__ == "__main__":
    setup_logging()
    exit_now(_rank_main())
