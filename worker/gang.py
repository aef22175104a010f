"""Jobs across machines: the worker that claims one leads it (node 0), the others join it from the queue.

The leader records the attempt's rendezvous on the job row, asks for `nodes - 1` members with join tasks
on the job's queue, and starts its torchrun, which hosts the c10d store; each member registers itself
(`job_nodes`), heartbeats, and starts its own torchrun against that store. torchrun forms the gang and,
for an elastic job, re-forms it when a machine leaves or joins. Everything is fenced by the attempt: a
late join for an older attempt is dropped, and a member whose job moved on stops its ranks.

Failures the leader turns into job outcomes: the gang never formed within `PEAGLE_GANG_TIMEOUT_S`
(`gang_incomplete`, naming how many machines joined), or a member died mid-run (`NodeLost`: the runner
requeues the job, which resumes from its last checkpoint on whatever machines join next).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from peagle_core.errors import PeagleError
from peagle_core.pipeline.stages import Callbacks
from peagle_core.spec import JobSpec, parse_spec
from peagle_core.training.result import PipelineResult
from service.artifacts import ArtifactStore
from service.crud import gang as gang_crud
from service.db.session import session_factory
from service.queue import enqueue_join, redis_from_url
from service.settings import Settings
from worker.attempt import AttemptContext
from worker.job_io import write_event
from worker.monitor import JobMonitor, stale_after_s
from worker.multigpu import (
    JobAbandoned,
    RankLaunch,
    rank_device,
    ranks_started,
    run_ranks,
    train_distributed,
)
from worker.rendezvous import Rendezvous, free_port

log = logging.getLogger(__name__)


class NodeLost(PeagleError):
    """A machine of the gang died mid-run and the job cannot go on without it."""

    code = "node_lost"


class GangLeader:
    """The training stage of a multi-node job, run by the worker that claimed it."""

    def __init__(
        self,
        settings: Settings,
        ctx: AttemptContext,
        worker_name: str,
        *,
        preempted: threading.Event,
        prepared_key: Callable[[], str | None],
    ):
        self.settings = settings
        self.ctx = ctx
        self.worker_name = worker_name
        self.preempted = preempted
        self.prepared_key = prepared_key

    def train(
        self, spec: JobSpec, work_dir: Path, dataset_dir: Path, cache_dir: Path, cb: Callbacks, _resume: bool
    ) -> PipelineResult:
        res = spec.resources
        rendezvous = Rendezvous(
            endpoint=f"{self.settings.worker_address}:{free_port()}",
            run_id=f"{self.ctx.job_id}-{self.ctx.attempt}",
            nodes_min=res.nodes_min,
            nodes_max=res.nodes_max,
            join_timeout_s=self.settings.gang_timeout_s,
            max_restarts=self.settings.elastic_max_restarts,
        )
        record = {
            **rendezvous.to_dict(),
            "leader": self.worker_name,
            "spec": spec.model_dump(mode="json", exclude_unset=True),
            "out_dir": str(work_dir),
            "dataset_dir": str(dataset_dir),
            "dataset_key": self.prepared_key(),
            "cache_dir": str(cache_dir),
        }
        with self.ctx.sessions() as session:
            held = gang_crud.set_gang(session, self.ctx.job_id, self.ctx.attempt, record)
            session.commit()
        if not held:
            return PipelineResult.stopped()  # the runner finds the job lost and drops this attempt
        redis = redis_from_url(self.settings.redis_url)
        for slot in range(1, res.nodes_max):
            enqueue_join(
                redis, self.ctx.job_id, self.ctx.attempt, slot, self._queue(spec),
                timeout_s=self.settings.job_timeout_s, wait_s=self.settings.gang_timeout_s,
            )  # fmt: skip
        cb.log(
            "gang",
            f"waiting up to {self.settings.gang_timeout_s:g}s for {_wanted(spec)} machines (rendezvous "
            f"{rendezvous.run_id})",
            nodes=res.nodes,
            run_id=rendezvous.run_id,
        )
        try:
            launch = RankLaunch(self.settings, self.ctx.job_id, spec, work_dir, dataset_dir, cache_dir, self.ctx.attempt,
                                self.worker_name)  # fmt: skip
            return train_distributed(launch, preempted=self.preempted, rendezvous=rendezvous)
        except PeagleError as exc:
            if not ranks_started(work_dir, self.ctx.attempt):
                raise self._incomplete(spec) from exc
            lost = self._lost_members()
            if lost:
                names = ", ".join(f"node {m.slot} on {m.worker_name}" for m in lost)
                raise NodeLost(
                    f"{names} stopped mid-run ({exc.message}); the job resumes from its last checkpoint"
                ) from exc
            raise

    @staticmethod
    def _queue(spec: JobSpec) -> str:
        return spec.resources.queue

    def _incomplete(self, spec: JobSpec) -> PeagleError:
        with self.ctx.sessions() as session:
            joined = 1 + len(gang_crud.members(session, self.ctx.job_id, self.ctx.attempt))
        return PeagleError(
            f"only {joined} of {_wanted(spec)} machines joined within {self.settings.gang_timeout_s:g}s "
            f"(resources.nodes={spec.resources.nodes}); start more workers on queue "
            f"{spec.resources.queue!r} or raise PEAGLE_GANG_TIMEOUT_S",
            code="gang_incomplete",
            param="resources.nodes",
        )

    def _lost_members(self) -> list[Any]:
        """Members that died (heartbeat gone stale without leaving), once every member has either left or
        gone stale; waits at most one staleness period."""
        stale_s = stale_after_s(self.settings.worker_heartbeat_s)
        deadline = time.monotonic() + stale_s + 2 * self.settings.worker_heartbeat_s
        while True:
            with self.ctx.sessions() as session:
                lost = gang_crud.lost_members(session, self.ctx.job_id, self.ctx.attempt, stale_s)
                settled = all(
                    m.left_at is not None
                    for m in gang_crud.members(session, self.ctx.job_id, self.ctx.attempt)
                )
                session.expunge_all()
            if lost or settled or time.monotonic() > deadline:
                return lost
            time.sleep(self.settings.worker_heartbeat_s / 2)  # polling the members' heartbeats


def _wanted(spec: JobSpec) -> str:
    res = spec.resources
    return f"at least {res.nodes_min} (up to {res.nodes_max})" if res.elastic else str(res.nodes_max)


class GangMember:
    """One join task: this worker becomes member `slot` of `attempt` of a multi-node job."""

    def __init__(self, settings: Settings, job_id: str, attempt: int, slot: int, worker_name: str):
        self.settings = settings
        self.ctx = AttemptContext(session_factory(settings.database_url), job_id, attempt)
        self.slot = slot
        self.worker_name = worker_name

    def run(self) -> str:
        """ "stale" (the attempt moved on or the slot is taken), "unfit" (this machine has too few GPUs),
        "lost" (the job moved on while running), or "left" (its torchrun ended)."""
        with self.ctx.sessions() as session:
            gang = gang_crud.gang_of(session, self.ctx.job_id, self.ctx.attempt)
        spec = parse_spec(gang["spec"]) if gang is not None else None
        if spec is not None and not self._fits(spec):
            return "unfit"
        with self.ctx.sessions() as session:
            joined = gang is not None and gang_crud.join(
                session, self.ctx.job_id, self.ctx.attempt, self.slot, self.worker_name
            )
        if not joined or gang is None or spec is None:
            log.info(
                "join of job %s attempt %d node %d is stale; dropped",
                self.ctx.job_id,
                self.ctx.attempt,
                self.slot,
            )
            return "stale"
        write_event(
            self.ctx.sessions, self.ctx.job_id, self.ctx.attempt, "log",
            f"node {self.slot} joined on {self.worker_name}",
            {"kind": "gang", "node": self.slot, "worker": self.worker_name},
        )  # fmt: skip
        monitor = JobMonitor(
            self.ctx,
            heartbeat_s=self.settings.worker_heartbeat_s,
            slot=self.slot,
        ).start()
        monitor.stop_on_signal()
        code = -1
        try:
            out_dir = self._local_dir(gang["out_dir"])
            launch = RankLaunch(self.settings, self.ctx.job_id, spec, out_dir, self._dataset_dir(gang, out_dir),
                                self._cache_dir(gang, out_dir), self.ctx.attempt, self.worker_name)  # fmt: skip
            code = run_ranks(
                launch, result_path=out_dir / f"result-attempt{self.ctx.attempt}-node{self.slot}.json",
                preempted=monitor.preempted, rendezvous=Rendezvous.from_dict(gang), leader=False,
                abort=monitor.lost, node=self.slot,
            )  # fmt: skip
        except JobAbandoned:
            log.warning(
                "job %s is no longer attempt %d's; node %d stopped",
                self.ctx.job_id,
                self.ctx.attempt,
                self.slot,
            )
            return "lost"
        finally:
            monitor.stop()
            with self.ctx.sessions() as session:
                gang_crud.leave(session, self.ctx.job_id, self.ctx.attempt, self.slot, code)
                session.commit()
        return "left"

    def _fits(self, spec: JobSpec) -> bool:
        """Whether this machine can run its share (`resources.gpus` ranks); if not, it says so on the job
        and stays out of the gang, which then fails `gang_incomplete` unless another worker joins."""
        try:
            rank_device(spec.resources.gpus)
        except PeagleError as exc:
            write_event(
                self.ctx.sessions, self.ctx.job_id, self.ctx.attempt, "log",
                f"node {self.slot} on {self.worker_name} cannot join: {exc.message}",
                {"kind": "gang", "worker": self.worker_name, "code": exc.code}, level="warning",
            )  # fmt: skip
            return False
        return True

    def _local_dir(self, leader_dir: str) -> Path:
        """The leader's work directory where this machine sees it too (same machine, or a shared file
        system: sharded checkpoints then land in one place), else one of this machine's own."""
        path = Path(leader_dir)
        if path.is_dir():
            return path
        own = (
            Path(self.settings.data_dir)
            / "scratch"
            / "jobs"
            / self.ctx.job_id
            / f"attempt-{self.ctx.attempt}"
        )
        own.mkdir(parents=True, exist_ok=True)
        return own

    def _dataset_dir(self, gang: dict[str, Any], out_dir: Path) -> Path:
        path = Path(gang["dataset_dir"])
        if (path / "manifest.json").is_file() or not gang.get("dataset_key"):
            return path
        return ArtifactStore(self.settings.artifact_root).fetch_dir(gang["dataset_key"], out_dir / "prepared")

    def _cache_dir(self, gang: dict[str, Any], out_dir: Path) -> Path:
        path = Path(gang["cache_dir"])
        return path if path.parent.is_dir() else out_dir / "cache"
