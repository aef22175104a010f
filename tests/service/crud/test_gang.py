"""Multi-node jobs in the service: `resources.nodes` is validated, and the gang's records are fenced by the
attempt (a late join for an older attempt, a duplicate join, a stale member's heartbeat all change nothing)."""

from __future__ import annotations

from typing import Any

import pytest

from service.crud import gang, jobstate
from service.crud.jobs import create_job_row
from service.crud.projects import get_or_create_project
from service.db.models import Job
from service.db.session import session_factory
from tests.service.conftest import create_job as post_job


@pytest.fixture
def running_job(db_url: str) -> str:
    """A job claimed once (attempt 1)."""
    with session_factory(db_url)() as s:
        project = get_or_create_project(s, "gang-tests")
        job = create_job_row(s, project.id, {"resources": {"queue": "default", "nodes": 2}}, max_attempts=3)
        s.commit()
        assert jobstate.claim(s, job.id, "leader")
        return job.id


def test_members_join_the_attempt_that_holds_the_job_once(db_url: str, running_job: str) -> None:
    with session_factory(db_url)() as s:
        assert gang.gang_of(s, running_job, 1) is None  # the leader has not recorded it yet
        assert gang.set_gang(s, running_job, 1, {"endpoint": "10.0.0.1:29400", "nodes_max": 2})
        s.commit()
        assert not gang.set_gang(s, running_job, 2, {"endpoint": "x:1"})  # not the holder's
        assert gang.gang_of(s, running_job, 1)["endpoint"] == "10.0.0.1:29400"
        assert gang.gang_of(s, running_job, 0) is None  # a join left over from an older attempt

        assert gang.join(s, running_job, 1, 1, "member-a")
        assert not gang.join(s, running_job, 1, 1, "member-b")  # the slot is taken: a duplicate delivery
        assert not gang.join(s, running_job, 0, 2, "member-c")  # an older attempt's join
        assert [m.worker_name for m in gang.members(s, running_job, 1)] == ["member-a"]
        assert gang.node_heartbeat(s, running_job, 1, 1)
        assert gang.lost_members(s, running_job, 1, stale_s=60) == []
        assert [m.slot for m in gang.lost_members(s, running_job, 1, stale_s=-1)] == [1]

        # The job moves on (the leader died and it is requeued): the member's writes are refused.
        assert jobstate.transition(s, running_job, "queued", expect=("running",), fence=1)
        assert not gang.node_heartbeat(s, running_job, 1, 1)
        assert gang.gang_of(s, running_job, 1) is None
        assert jobstate.claim(s, running_job, "leader-2")
        assert s.get(Job, running_job).attempt == 2
        assert not gang.join(s, running_job, 1, 1, "late")  # a stale join of attempt 1 cannot enter 2


@pytest.mark.parametrize(
    ("nodes", "accepted"),
    [(2, True), ("2:4", True), (0, False), (17, False), ("4:2", False), ("x", False), (True, False)],
)
def test_the_api_checks_resources_nodes(
    client: Any, auth: dict[str, str], spec: dict[str, Any], nodes: Any, accepted: bool
) -> None:
    body = {**spec, "resources": {"nodes": nodes}}
    if accepted:
        assert post_job(client, auth, body)["spec"]["resources"]["nodes"] == nodes
        return
    r = client.post("/v1/jobs", json={"spec": body}, headers=auth)
    assert r.status_code == 422, r.text
    assert "resources.nodes" in r.text


def test_max_running_jobs_counts_machines(
    client: Any, auth: dict[str, str], spec: dict[str, Any], db_url: str
) -> None:
    """A job across N machines holds N of the project's `max_running_jobs`, so a cap of 3 admits one
    elastic job on up to 2 machines plus one single-machine job, and nothing more."""
    from service.crud.limits import set_limits
    from service.db.models import Project

    elastic = post_job(client, auth, {**spec, "resources": {"nodes": "1:2"}})
    with session_factory(db_url)() as s:
        job = s.get(Job, elastic["id"])
        set_limits(s, s.get(Project, job.project_id), max_running_jobs=3)
        s.commit()
    r = client.post("/v1/jobs", json={"spec": {**spec, "resources": {"nodes": 2}}}, headers=auth)
    assert r.status_code == 429, r.text
    assert "hold 2 machine(s) and this job asks for 2" in r.json()["error"]["message"]
    assert post_job(client, auth, spec)["status"] == "queued"
    r = client.post("/v1/jobs", json={"spec": spec}, headers=auth)
    assert r.status_code == 429 and "hold 3 machine(s)" in r.json()["error"]["message"]
