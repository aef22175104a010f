"""Fault scenarios against a real stack, one JSON line per scenario: trials, succeeded, lost, duplicated.

The stack is the API (uvicorn), two `peagle worker` processes (each with its reconciler sidecar and its
own scratch directory, i.e. its own "machine"), a private Postgres cluster and a private redis-server, all
on free ports of this machine (nothing shared is touched). Jobs are toy trainings submitted over HTTP.

    python bench/chaos.py                      # the issue's counts
    python bench/chaos.py --sigkill 3 --pg-outage 1 --redis-jobs 6 --freeze 1 --cross-machine 1 \
        --tracker-outage 1 --drain-multigpu 1 --dataset-race 10 --node-loss 1 --node-loss-elastic 1

Scenarios: `sigkill` (SIGKILL a worker's tree at a random point, start a replacement on the same scratch),
`pg_outage` (Postgres stopped for --outage-s mid-job), `redis_restart` (redis-server killed and restarted
with --redis-jobs queued jobs; it keeps no data), `freeze` (SIGSTOP the worker holding the job until the
reconciler requeues it, then SIGCONT), `cross_machine` (SIGKILL the holder, leave it dead: the other worker
resumes from the mirrored checkpoint; a worker on a fresh scratch directory then replaces it),
`tracker_outage` (Postgres stopped for --outage-s while a job reports to TensorBoard: the job succeeds, its
TensorBoard archive is served and at most one warning event is logged), `drain_multigpu` (SIGTERM the
worker holding a two-rank job (CPU ranks over gloo): the job is requeued with a checkpoint, resumes on a
replacement worker and succeeds), `dataset_race` (DELETE an uploaded dataset while a job naming it is
created, both at once: `orphaned` counts trials where both succeeded, i.e. a job queued on a deleted
dataset; every job so created is cancelled again), `node_loss` (a job on both workers as two machines,
`resources.nodes: 2`: SIGKILL the member machine's worker tree mid-training; the job returns to the
queue and resumes from its last checkpoint once a replacement worker joins) and `node_loss_elastic` (the
same with `resources.nodes: "1:2"`: torchrun re-forms the gang on the survivor, which resumes from its
last checkpoint at world size 1). Both report `steps_lost` (steps trained again after the resume: the
highest step reached before it minus the step resumed from) and the world size of each start of the
ranks. `gang_cancel`: a two-machine job cancelled mid-training must end `cancelled` with a checkpoint
and no rank left running on either machine (not a success: it reports its own counts).

lost: a job that did not succeed within --deadline-s. duplicated: a job with more than one published
checkpoint, or whose metric rows show an older attempt writing after a newer one started (two attempts
running at once and both being heard).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from _common import emit, free_port  # noqa: E402
from _pg_cluster import PrivatePostgres, postgres_bindir  # noqa: E402


class Stack:
    """API + two workers + private Postgres + private Redis, torn down by `close()`."""

    def __init__(self, root: Path, *, heartbeat_s: float, reconcile_s: float):
        from peagle_core.toy import build_toy_verifier, write_toy_dataset
        from service.crud.projects import create_key
        from service.db.migrate import upgrade
        from service.db.session import session_scope

        self.root = root
        bindir = postgres_bindir()
        if bindir is None:
            raise SystemExit("chaos needs the Postgres server binaries (initdb, pg_ctl)")
        self.pg = PrivatePostgres(bindir)
        self.redis_port = free_port()
        self.redis: subprocess.Popen[bytes] | None = None
        self.start_redis()
        upgrade(self.pg.url)
        with session_scope(self.pg.url) as s:
            self.key, _ = create_key(s, "chaos")
        models, data = root / "models", root / "data"
        models.mkdir()
        data.mkdir()
        self.verifier = build_toy_verifier("test", seed=0, out=models / "toy")
        self.dataset = write_toy_dataset(data / "toy.jsonl", n=64, seed=0)
        self.env = {
            **os.environ,
            "PYTHONPATH": str(REPO),
            "PEAGLE_DATABASE_URL": self.pg.url,
            "PEAGLE_REDIS_URL": f"redis://127.0.0.1:{self.redis_port}/0",
            "PEAGLE_ARTIFACT_ROOT": str(root / "artifacts"),
            "PEAGLE_ALLOWED_MODEL_ROOTS": str(models),
            "PEAGLE_ALLOWED_DATA_ROOTS": str(data),
            "PEAGLE_WORKER_HEARTBEAT_S": str(heartbeat_s),
            "PEAGLE_RECONCILE_INTERVAL_S": str(reconcile_s),
            "OMP_NUM_THREADS": "1",
            # Two-rank jobs (drain_multigpu) run as CPU ranks over gloo on a machine without GPUs.
            "PEAGLE_ALLOW_CPU_MULTIPROCESS": "1",
        }
        self.api_port = free_port()
        self.api = self._spawn(
            "api",
            [sys.executable, "-m", "uvicorn", "service.app:create_app", "--factory", "--port",
             str(self.api_port), "--log-level", "warning", "--no-access-log"],
            data_dir=root / "api",
        )  # fmt: skip
        self.http = httpx.Client(
            base_url=f"http://127.0.0.1:{self.api_port}",
            headers={"Authorization": f"Bearer {self.key}"},
            timeout=10,
        )
        self._until("the API", lambda: self._get("/readyz") is not None, 120)
        self.machines = 0
        self.workers: list[subprocess.Popen[bytes]] = []
        for _ in range(2):
            self.add_worker()

    # -- processes ---------------------------------------------------------------------------------

    def _spawn(self, name: str, cmd: list[str], *, data_dir: Path) -> subprocess.Popen[bytes]:
        log = open(self.root / f"{name}.log", "ab")  # noqa: SIM115
        env = {**self.env, "PEAGLE_DATA_DIR": str(data_dir)}
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)

    def add_worker(self, machine: int | None = None) -> subprocess.Popen[bytes]:
        """A worker on scratch directory `machine` (a new one when None)."""
        if machine is None:
            self.machines += 1
            machine = self.machines
        proc = self._spawn(
            f"worker-m{machine}",
            [sys.executable, "-m", "cli", "worker"],
            data_dir=self.root / f"machine-{machine}",
        )
        proc.machine = machine  # type: ignore[attr-defined]
        self.workers.append(proc)
        return proc

    def holder(self) -> subprocess.Popen[bytes] | None:
        """The worker whose work horse is running a job (the pool parent's grandchild), if any."""
        for w in self.workers:
            if w.poll() is None and _horses(w.pid):
                return w
        return None

    def kill(self, worker: subprocess.Popen[bytes]) -> None:
        tree = [psutil.Process(worker.pid), *psutil.Process(worker.pid).children(recursive=True)]
        for p in tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        worker.wait()
        self.workers.remove(worker)

    def start_redis(self) -> None:
        self.redis = subprocess.Popen(
            ["redis-server", "--port", str(self.redis_port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        from service.queue import redis_from_url

        conn = redis_from_url(f"redis://127.0.0.1:{self.redis_port}/0")
        self._until("redis", lambda: _try(conn.ping), 30)

    def kill_redis(self) -> None:
        assert self.redis is not None
        self.redis.kill()
        self.redis.wait()

    def close(self) -> None:
        for w in list(self.workers):
            self.kill(w)
        for proc in (self.api, self.redis):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
        from service.db.session import dispose_engines

        dispose_engines()
        self.pg.close()

    # -- API ---------------------------------------------------------------------------------------

    def _get(self, path: str) -> Any:
        try:
            r = self.http.get(path)
        except httpx.HTTPError:
            return None
        return r.json() if r.status_code == 200 else None

    def submit(self, steps: int, **overrides: Any) -> str:
        r = self.http.post("/v1/jobs", json={"spec": self.spec(steps, **overrides)})
        r.raise_for_status()
        return r.json()["id"]

    def spec(self, steps: int, **overrides: Any) -> dict[str, Any]:
        spec: dict[str, Any] = {
            "verifier": {"name_or_path": str(self.verifier)},
            "dataset": {"path": str(self.dataset), "seq_len": 128, "val_fraction": 0.1},
            "hidden_states": {"mode": "online"},
            "model": {"num_layers": 1, "num_depths": 2, "draft_vocab_size": 256},
            "training": {"total_seq_len": 256, "lr": 1e-3, "max_steps": steps, "epochs": 100,
                         "checkpoint_every_steps": 5, "seed": 3},
            "evaluation": {"prompts": 1, "max_new_tokens": 8},
        }  # fmt: skip
        for section, values in overrides.items():
            spec[section] = {**spec.get(section, {}), **values}
        return spec

    def job(self, job_id: str) -> dict[str, Any] | None:
        return self._get(f"/v1/jobs/{job_id}")

    def wait_step(self, job_id: str, step: int, timeout: float) -> bool:
        def reached() -> bool:
            job = self.job(job_id)
            return bool(job and job["status"] == "running" and (job["progress"] or {}).get("step", 0) >= step)

        return self._until(f"{job_id} at step {step}", reached, timeout, fail=False)

    def wait_done(self, job_ids: list[str], timeout: float) -> dict[str, str]:
        final: dict[str, str] = {}

        def done() -> bool:
            for j in job_ids:
                if j not in final:
                    job = self.job(j)
                    if job and job["status"] in ("succeeded", "failed", "cancelled"):
                        final[j] = job["status"]
            return len(final) == len(job_ids)

        self._until("jobs to finish", done, timeout, fail=False)
        return final

    def _until(self, what: str, cond: Callable[[], Any], timeout: float, *, fail: bool = True) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if cond():
                return True
            time.sleep(0.5)
        if fail:
            raise SystemExit(f"timed out waiting for {what}")
        return False

    # -- verdicts ----------------------------------------------------------------------------------

    def duplicated(self, job_id: str) -> bool:
        from sqlalchemy import select

        from service.db.models import Checkpoint, JobMetric
        from service.db.retry import retry_transient
        from service.db.session import session_factory

        def read() -> tuple[int, list[Any]]:
            with session_factory(self.pg.url)() as s:
                ckpts = len(s.scalars(select(Checkpoint.id).where(Checkpoint.job_id == job_id)).all())
                rows = s.execute(
                    select(JobMetric.id, JobMetric.values).where(JobMetric.job_id == job_id)
                ).all()
                return ckpts, list(rows)

        # Our own pooled connections died with the Postgres restarts: the first use after one fails.
        ckpts, rows = retry_transient(read, tolerance_s=60, what="reading the verdict")
        first_id: dict[int, int] = {}
        last_id: dict[int, int] = {}
        for row_id, values in rows:
            a = int(values.get("attempt") or 0)
            first_id[a] = min(first_id.get(a, row_id), row_id)
            last_id[a] = max(last_id.get(a, row_id), row_id)
        interleaved = any(last_id[a] > first_id[b] for a in last_id for b in first_id if b > a)
        return ckpts > 1 or interleaved


def _horses(pid: int) -> list[psutil.Process]:
    """The work horses (and their torchrun ranks) under a `peagle worker` process: every descendant but
    its reconciler sidecar."""
    try:
        return [p for p in psutil.Process(pid).children(recursive=True) if "reconcile" not in p.cmdline()]
    except psutil.NoSuchProcess:
        return []


def _try(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception:
        return None


def _verdict(
    stack: Stack, scenario: str, job_ids: list[str], deadline_s: float, started: float, **extra: Any
) -> None:
    final = stack.wait_done(job_ids, deadline_s)
    succeeded = [j for j in job_ids if final.get(j) == "succeeded"]
    emit(
        bench="chaos",
        scenario=scenario,
        trials=len(job_ids),
        succeeded=len(succeeded),
        lost=len(job_ids) - len(succeeded),
        duplicated=sum(stack.duplicated(j) for j in job_ids),
        attempts=[(stack.job(j) or {}).get("attempt") for j in job_ids],
        wall_s=round(time.monotonic() - started, 1),
        **extra,
    )


# ------------------------------------------------------------------------------------------ scenarios


def scenario_sigkill(stack: Stack, trials: int, args: argparse.Namespace) -> None:
    started, jobs, kills = time.monotonic(), [], 0
    for _ in range(trials):
        job_id = stack.submit(args.steps)
        jobs.append(job_id)
        # A random point of the run: anywhere from the first step to just before the last.
        stack.wait_step(job_id, random.randint(1, args.steps - 10), args.deadline_s)
        victim = stack.holder()
        if victim is not None:
            kills += 1
            machine = victim.machine  # type: ignore[attr-defined]
            stack.kill(victim)
            stack.add_worker(machine)  # the machine reboots: same scratch directory
        stack.wait_done([job_id], args.deadline_s)
    _verdict(stack, "sigkill", jobs, args.deadline_s, started, kills=kills)


def scenario_pg_outage(stack: Stack, trials: int, args: argparse.Namespace) -> None:
    started, jobs, api_503 = time.monotonic(), [], 0
    for _ in range(trials):
        job_id = stack.submit(args.steps)
        jobs.append(job_id)
        stack.wait_step(job_id, 2, args.deadline_s)
        stack.pg.stop()
        until = time.monotonic() + args.outage_s
        while time.monotonic() < until:
            r = _try(lambda j=job_id: stack.http.get(f"/v1/jobs/{j}"))
            api_503 += bool(r is not None and r.status_code == 503 and r.headers.get("Retry-After"))
            time.sleep(2.0)
        stack.pg.start()
        stack.wait_done([job_id], args.deadline_s)
    _verdict(
        stack,
        "pg_outage",
        jobs,
        args.deadline_s,
        started,
        outage_s=args.outage_s,
        api_503_with_retry_after=api_503,
    )


def scenario_redis_restart(stack: Stack, trials: int, args: argparse.Namespace) -> None:
    started = time.monotonic()
    jobs = [stack.submit(2) for _ in range(trials)]
    stack.kill_redis()  # no persistence: every queued RQ job is gone
    stack.start_redis()
    _verdict(stack, "redis_restart", jobs, args.deadline_s * max(1, trials // 2), started)


def scenario_freeze(stack: Stack, trials: int, args: argparse.Namespace) -> None:
    started, jobs = time.monotonic(), []
    for _ in range(trials):
        job_id = stack.submit(args.steps)
        jobs.append(job_id)
        stack.wait_step(job_id, 2, args.deadline_s)
        victim = stack.holder()
        if victim is not None:
            tree = [psutil.Process(victim.pid), *psutil.Process(victim.pid).children(recursive=True)]
            for p in tree:
                p.suspend()
            try:
                # Frozen until a reconciler (the other worker's) presumes it dead and requeues the job.
                stack._until(
                    "a requeue",
                    lambda j=job_id: (stack.job(j) or {}).get("attempt", 1) >= 2,
                    args.deadline_s,
                    fail=False,
                )
            finally:
                for p in tree:
                    _try(p.resume)
        stack.wait_done([job_id], args.deadline_s)
    _verdict(stack, "heartbeat_freeze", jobs, args.deadline_s, started)


def scenario_cross_machine(stack: Stack, trials: int, args: argparse.Namespace) -> None:
    started, jobs, resumed_from = time.monotonic(), [], []
    for _ in range(trials):
        job_id = stack.submit(args.steps)
        jobs.append(job_id)
        stack.wait_step(job_id, 6, args.deadline_s)  # a checkpoint (every 5 steps) is mirrored
        victim = stack.holder()
        if victim is not None:
            stack.kill(victim)  # the machine is gone for good
        stack.wait_done([job_id], args.deadline_s)
        events = stack._get(f"/v1/jobs/{job_id}/events?limit=1000") or {"data": []}
        steps = [e["data"]["resume_step"] for e in events["data"] if (e.get("data") or {}).get("resume_step")]
        resumed_from.append(steps[-1] if steps else 0)
        stack.add_worker()  # a new machine with an empty scratch directory joins
    _verdict(stack, "cross_machine", jobs, args.deadline_s, started, resumed_from_step=resumed_from)


def scenario_tracker_outage(stack: Stack, trials: int, args: argparse.Namespace) -> None:
    started, jobs, published, warnings = time.monotonic(), [], 0, []
    for _ in range(trials):
        job_id = stack.submit(args.steps, tracking={"report_to": ["tensorboard"]})
        jobs.append(job_id)
        stack.wait_step(job_id, 2, args.deadline_s)
        stack.pg.stop()
        time.sleep(args.outage_s)  # the outage itself: nothing to wait for
        stack.pg.start()
        stack.wait_done([job_id], args.deadline_s)
        r = _try(lambda j=job_id: stack.http.get(f"/v1/jobs/{j}/tensorboard"))
        published += bool(r is not None and r.status_code == 200 and r.content)
        events = stack._get(f"/v1/jobs/{job_id}/events?limit=1000") or {"data": []}
        warnings.append(sum(e["level"] == "warning" for e in events["data"]))
    _verdict(
        stack,
        "tracker_outage",
        jobs,
        args.deadline_s,
        started,
        outage_s=args.outage_s,
        tensorboard_published=published,
        warning_events=warnings,
    )


def scenario_drain_multigpu(stack: Stack, trials: int, args: argparse.Namespace) -> None:
    started, jobs, requeued_with_checkpoint = time.monotonic(), [], 0
    for _ in range(trials):
        job_id = stack.submit(args.steps, resources={"gpus": 2})
        jobs.append(job_id)
        stack.wait_step(job_id, 2, args.deadline_s)
        victim = stack.holder()
        if victim is not None:
            machine = victim.machine  # type: ignore[attr-defined]
            victim.send_signal(signal.SIGTERM)  # a drain: warm shutdown
            with contextlib.suppress(subprocess.TimeoutExpired):
                victim.wait(timeout=args.deadline_s)
            if victim.poll() is None:
                stack.kill(victim)
            else:
                stack.workers.remove(victim)
            events = stack._get(f"/v1/jobs/{job_id}/events?limit=1000") or {"data": []}
            requeued_with_checkpoint += any(
                "worker shutting down" in e["message"] and (e.get("data") or {}).get("checkpoint_saved")
                for e in events["data"]
            )
            stack.add_worker(machine)
        stack.wait_done([job_id], args.deadline_s)
    _verdict(
        stack,
        "drain_multigpu",
        jobs,
        args.deadline_s,
        started,
        requeued_with_checkpoint=requeued_with_checkpoint,
    )


def _gang_member(stack: Stack, job_id: str) -> subprocess.Popen[bytes] | None:
    """The worker serving as a member machine of the job's current attempt (its name ends in its pid)."""
    from sqlalchemy import select

    from service.db.models import Job, JobNode
    from service.db.session import session_factory

    with session_factory(stack.pg.url)() as s:
        attempt = s.scalar(select(Job.attempt).where(Job.id == job_id))
        names = s.scalars(
            select(JobNode.worker_name).where(
                JobNode.job_id == job_id, JobNode.attempt == attempt, JobNode.left_at.is_(None)
            )
        ).all()
    return next((w for w in stack.workers if any(n.endswith(f".{w.pid}") for n in names)), None)


def _node_loss(stack: Stack, trials: int, args: argparse.Namespace, *, nodes: int | str, name: str) -> None:
    started, jobs, kills, steps_lost, worlds, resumes = time.monotonic(), [], 0, [], [], []
    for _ in range(trials):
        # Our decoder only: the scenario is about training, and no vLLM engine starts on a CPU box.
        job_id = stack.submit(
            args.steps,
            resources={"nodes": nodes},
            evaluation={"engine": "peagle"},
            export={"vllm_check": False},
        )
        jobs.append(job_id)
        # Past the first periodic checkpoint (every 5 steps), with the member machine in the world.
        victim = None
        if stack.wait_step(job_id, 8, args.deadline_s):
            stack._until("a member machine", lambda j=job_id: _gang_member(stack, j), 60, fail=False)
            victim = _gang_member(stack, job_id)
        if victim is not None:
            machine = victim.machine  # type: ignore[attr-defined]
            stack.kill(victim)
            kills += 1
            stack.add_worker(machine)  # the machine comes back (a fresh worker on its scratch)
        stack.wait_done([job_id], args.deadline_s)
        steps_lost.append(_steps_trained_twice(stack, job_id))
        events = (stack._get(f"/v1/jobs/{job_id}/events?limit=1000") or {"data": []})["data"]
        # The trainer's resumes: [step, world size that wrote the checkpoint, world size now].
        resumes.append(
            [
                [d["step"], d.get("from_world_size"), d.get("world_size")]
                for e in events
                if (d := e["data"] or {}).get("kind") == "resume" and "step" in d
            ]
        )
        # One entry per start of the ranks (a requeue, or torchrun re-forming the gang): its world size.
        worlds.append(
            [
                d["world_size"]
                for e in events
                if (d := e["data"] or {}).get("kind") == "rank" and d["rank"] == 0
            ]
        )
    _verdict(
        stack, name, jobs, args.deadline_s, started, kills=kills, steps_lost=steps_lost, world_sizes=worlds,
        resumes=resumes,
    )  # fmt: skip


def _steps_trained_twice(stack: Stack, job_id: str) -> int:
    """Steps trained again after a resume: each time the training metric rows' step goes back, the steps
    from the resumed one up to the highest before it were lost."""
    from sqlalchemy import select

    from service.db.models import JobMetric
    from service.db.session import session_factory

    with session_factory(stack.pg.url)() as s:
        rows = s.execute(
            select(JobMetric.step, JobMetric.values).where(JobMetric.job_id == job_id).order_by(JobMetric.id)
        )
        steps = [step for step, values in rows if "loss" in values]
    return sum(prev - (step - 1) for prev, step in itertools.pairwise(steps) if step <= prev)


def scenario_node_loss(stack: Stack, trials: int, args: argparse.Namespace) -> None:
    _node_loss(stack, trials, args, nodes=2, name="node_loss")


def scenario_node_loss_elastic(stack: Stack, trials: int, args: argparse.Namespace) -> None:
    _node_loss(stack, trials, args, nodes="1:2", name="node_loss_elastic")


def scenario_gang_cancel(stack: Stack, trials: int, args: argparse.Namespace) -> None:
    """A two-machine job cancelled mid-training: it ends `cancelled` with a checkpoint, and no rank is
    left on either machine (the member hears the cancel through its own monitor, like the leader)."""
    started, outcomes = time.monotonic(), {"cancelled": 0, "with_checkpoint": 0, "ranks_left": 0}
    jobs = []
    for _ in range(trials):
        job_id = stack.submit(
            args.steps, resources={"nodes": 2}, evaluation={"engine": "peagle"}, export={"vllm_check": False}
        )
        jobs.append(job_id)
        if stack.wait_step(job_id, 4, args.deadline_s):
            stack._until("a member machine", lambda j=job_id: _gang_member(stack, j), 60, fail=False)
        stack.http.post(f"/v1/jobs/{job_id}/cancel").raise_for_status()
        final = stack.wait_done([job_id], args.deadline_s)
        outcomes["cancelled"] += final.get(job_id) == "cancelled"
        events = (stack._get(f"/v1/jobs/{job_id}/events?limit=1000") or {"data": []})["data"]
        outcomes["with_checkpoint"] += any((e.get("data") or {}).get("checkpoint_saved") for e in events)
        # The horses exit with their ranks; whatever still runs `worker.multigpu` for this job was orphaned.
        stack._until(
            "both machines' ranks gone",
            lambda j=job_id: not any(j in " ".join(_try(p.cmdline) or []) for p in psutil.process_iter()),
            60,
            fail=False,
        )
        outcomes["ranks_left"] += sum(j in " ".join(_try(p.cmdline) or []) for p in psutil.process_iter()
                                      for j in [job_id])  # fmt: skip
    emit(bench="chaos", scenario="gang_cancel", trials=trials, **outcomes,
         wall_s=round(time.monotonic() - started, 1))  # fmt: skip


def scenario_dataset_race(stack: Stack, trials: int, args: argparse.Namespace) -> None:
    import threading

    started = time.monotonic()
    outcomes = {"orphaned": 0, "create_won": 0, "delete_won": 0, "other": 0}
    for _ in range(trials):
        r = stack.http.post("/v1/datasets", files={"file": ("toy.jsonl", Path(stack.dataset).read_bytes())})
        r.raise_for_status()
        ds = r.json()["id"]
        spec = stack.spec(2, dataset={"path": None, "id": ds})
        spec["dataset"].pop("path")
        gate, answers = threading.Barrier(2), {}

        def call(
            name: str,
            fn: Callable[[], httpx.Response],
            gate: threading.Barrier = gate,
            answers: dict[str, httpx.Response] = answers,
        ) -> None:
            gate.wait()  # both requests leave together
            answers[name] = fn()

        threads = [
            threading.Thread(
                target=call, args=("delete", lambda d=ds: stack.http.delete(f"/v1/datasets/{d}"))
            ),
            threading.Thread(
                target=call, args=("create", lambda sp=spec: stack.http.post("/v1/jobs", json={"spec": sp}))
            ),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        created, deleted = answers["create"].status_code == 201, answers["delete"].status_code == 200
        if created and deleted:
            outcomes["orphaned"] += 1
        elif created and answers["delete"].status_code == 409:
            outcomes["create_won"] += 1
        elif deleted and answers["create"].status_code == 422:
            outcomes["delete_won"] += 1
        else:
            outcomes["other"] += 1
        if created:
            stack.http.post(f"/v1/jobs/{answers['create'].json()['id']}/cancel")
    emit(bench="chaos", scenario="dataset_race", trials=trials, **outcomes,
         wall_s=round(time.monotonic() - started, 1))  # fmt: skip


SCENARIOS = {
    "sigkill": scenario_sigkill,
    "pg_outage": scenario_pg_outage,
    "redis_jobs": scenario_redis_restart,
    "freeze": scenario_freeze,
    "cross_machine": scenario_cross_machine,
    "tracker_outage": scenario_tracker_outage,
    "drain_multigpu": scenario_drain_multigpu,
    "dataset_race": scenario_dataset_race,
    "node_loss": scenario_node_loss,
    "node_loss_elastic": scenario_node_loss_elastic,
    "gang_cancel": scenario_gang_cancel,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sigkill", type=int, default=10)
    ap.add_argument("--pg-outage", type=int, default=3)
    ap.add_argument("--redis-jobs", type=int, default=20)
    ap.add_argument("--freeze", type=int, default=3)
    ap.add_argument("--cross-machine", type=int, default=3)
    ap.add_argument("--tracker-outage", type=int, default=2)
    ap.add_argument("--drain-multigpu", type=int, default=3)
    ap.add_argument("--dataset-race", type=int, default=30)
    ap.add_argument("--node-loss", type=int, default=2)
    ap.add_argument("--node-loss-elastic", type=int, default=2)
    ap.add_argument("--gang-cancel", type=int, default=2)
    ap.add_argument("--outage-s", type=float, default=60.0)
    ap.add_argument(
        "--steps", type=int, default=200, help="training steps per job (~15 steps/s on a free core)"
    )
    ap.add_argument("--deadline-s", type=float, default=600.0, help="per job, before it counts as lost")
    ap.add_argument("--heartbeat-s", type=float, default=1.0)
    ap.add_argument("--reconcile-s", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep", action="store_true", help="keep the stack's directory (logs) afterwards")
    args = ap.parse_args()
    random.seed(args.seed)

    root = Path(tempfile.mkdtemp(prefix="peagle-chaos-"))
    stack = Stack(root, heartbeat_s=args.heartbeat_s, reconcile_s=args.reconcile_s)
    counts = {
        "sigkill": args.sigkill,
        "pg_outage": args.pg_outage,
        "redis_jobs": args.redis_jobs,
        "freeze": args.freeze,
        "cross_machine": args.cross_machine,
        "tracker_outage": args.tracker_outage,
        "drain_multigpu": args.drain_multigpu,
        "dataset_race": args.dataset_race,
        "node_loss": args.node_loss,
        "node_loss_elastic": args.node_loss_elastic,
        "gang_cancel": args.gang_cancel,
    }
    try:
        for name, trials in counts.items():
            if trials > 0:
                SCENARIOS[name](stack, trials, args)
    finally:
        stack.close()
        if args.keep:
            print(f"# logs: {root}", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    main()
