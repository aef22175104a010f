"""Jobs across machines: worker processes act as the machines of one job (CPU ranks over gloo)."""

from __future__ import annotations

from pathlib import Path

from tests.worker.conftest import Stack, toy_spec


def _as_machines(stack: Stack, *, gang_timeout_s: float) -> None:
    stack.env.update(
        PEAGLE_ALLOW_CPU_MULTIPROCESS="1",
        CUDA_VISIBLE_DEVICES="",
        OMP_NUM_THREADS="1",
        PEAGLE_GANG_TIMEOUT_S=str(gang_timeout_s),
    )


def test_two_workers_train_one_job_as_two_nodes(
    stack: Stack, toy_verifier_dir: Path, toy_dataset_path: Path
) -> None:
    from service.crud.gang import members

    _as_machines(stack, gang_timeout_s=120)
    spec = toy_spec(toy_verifier_dir, toy_dataset_path, resources={"nodes": 2}, evaluation={"prompts": 1})
    job_id = stack.submit(spec)
    stack.worker(log_name="leader")
    stack.worker(log_name="member")
    job = stack.wait_for(
        "the job to finish",
        lambda: (j := stack.job(job_id)).status in ("succeeded", "failed") and j,
        timeout=400,
    )
    assert job.status == "succeeded", (job.error, [e.message for e in stack.events(job_id)])

    events = stack.events(job_id)
    # Two machines of one rank each formed one world of two; rank 0 ran beside the leader.
    ranks = sorted(e.data["rank"] for e in events if e.data and e.data.get("kind") == "rank")
    assert ranks == [0, 1]
    (train_event,) = [e for e in events if e.type == "stage" and e.message == "training"]
    assert train_event.data["world_size"] == 2
    assert sorted({m["step"] for m in stack.metrics(job_id) if "loss" in m}) == [1, 2, 3, 4]
    (node,) = [e for e in events if e.data and e.data.get("kind") == "gang" and "node" in e.data]
    assert node.data["node"] == 1 and node.data["worker"] != job.worker_name

    def member_exit() -> tuple[str, int] | None:
        with stack.sessions() as s:
            (member,) = members(s, job_id, job.attempt)
            return None if member.exit_code is None else (member.worker_name, member.exit_code)

    # The member notes its exit after its own torchrun ends, which can be after the leader published.
    assert stack.wait_for("the member to note its exit", member_exit, timeout=120) == (node.data["worker"], 0)
    assert job.gang["run_id"] == f"{job_id}-{job.attempt}" and job.gang["nodes_max"] == 2
    (ckpt,) = stack.checkpoints(job_id)
    assert ckpt.step == 4


def test_a_gang_that_never_forms_fails_naming_who_joined(
    stack: Stack, toy_verifier_dir: Path, toy_dataset_path: Path
) -> None:
    _as_machines(stack, gang_timeout_s=3)
    spec = toy_spec(toy_verifier_dir, toy_dataset_path, resources={"nodes": "3:4"})
    job_id = stack.submit(spec)
    stack.run_burst()  # the only machine: it leads, and no member ever comes
    job = stack.job(job_id)
    assert job.status == "failed"
    assert job.error["code"] == "gang_incomplete"
    assert job.error["param"] == "resources.nodes"
    assert "only 1 of at least 3 (up to 4) machines joined within 3s" in job.error["message"]
    assert stack.checkpoints(job_id) == []


def test_a_join_for_an_older_attempt_starts_nothing(
    stack: Stack, toy_verifier_dir: Path, toy_dataset_path: Path
) -> None:
    from service.crud import gang, jobstate
    from worker.gang import GangMember

    job_id = stack.submit(toy_spec(toy_verifier_dir, toy_dataset_path, resources={"nodes": 2}), enqueue=False)
    with stack.sessions() as s:
        assert jobstate.claim(s, job_id, "leader")
        assert gang.set_gang(s, job_id, 1, {"endpoint": "127.0.0.1:1", "nodes_max": 2})
        s.commit()
    # Delivered after the job moved on to attempt 1 (e.g. a join queued for an attempt that was requeued).
    assert GangMember(stack.settings, job_id, 0, 1, "late-worker").run() == "stale"
    with stack.sessions() as s:
        assert gang.members(s, job_id, 1) == [] and gang.members(s, job_id, 0) == []


def test_the_leaders_ranks_come_first_whatever_torchrun_chose() -> None:
    from worker.multigpu import leader_first_rank

    # 3 machines of 2 ranks; torchrun put the leader's machine third.
    renumbered = [leader_first_rank(r, 2, 2) for r in range(6)]
    assert renumbered == [(4, 2), (5, 2), (2, 1), (3, 1), (0, 0), (1, 0)]
    assert sorted(r for r, _ in renumbered) == list(range(6))  # still one rank each
    assert [leader_first_rank(r, 2, 0) for r in range(4)] == [(0, 0), (1, 0), (2, 1), (3, 1)]
