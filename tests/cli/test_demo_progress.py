"""`peagle demo` follows its job under the shared live progress bar (client/progress_bar.py): with no terminal it
prints the job's stage and status events and the bar's plain lines; it waits as long as the job runs unless
given a timeout, and past the timeout or on Ctrl-C it stops with one error line saying what becomes of the job."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import typer

from cli.demo import _follow_with_progress
from client import PeagleClient
from tests.fixtures.stack import serve_app


@pytest.fixture
def running_job(
    app: Any, redis_conn: Any, api_key: str, settings: Any
) -> Iterator[tuple[PeagleClient, str, Any]]:
    """(a client of the served API, a job of its project that worker attempt 1 runs, that job's reporter)."""
    from service.crud import jobstate
    from service.crud.jobs import create_job_row
    from service.crud.projects import project_for_key
    from service.db.session import session_factory
    from worker.attempt import AttemptContext
    from worker.job_io import JobReporter
    from worker.progress import ProgressWriter

    sessions = session_factory(settings.database_url)
    with sessions() as session:
        project = project_for_key(session, api_key)
        assert project is not None
        spec = {"verifier": {"name_or_path": "/nowhere"}, "dataset": {"path": "/nowhere.jsonl"}}
        job_id = create_job_row(session, project.id, spec, max_attempts=1).id
        session.commit()
        assert jobstate.claim(session, job_id, "w1")
    writer = ProgressWriter(AttemptContext(sessions, job_id, 1))  # not started: flush() writes right here
    with serve_app(app) as url, PeagleClient(url, api_key) as client:
        yield client, job_id, JobReporter(writer, on_stage=writer.set_stage)


def test_the_demo_prints_stages_and_the_bars_last_line(
    running_job, capsys: pytest.CaptureFixture[str]
) -> None:
    from peagle_core.events import Event
    from service.crud import jobstate

    client, job_id, reporter = running_job
    reporter.on_event(Event("prepare", "preparing data"))
    reporter.on_event(Event("train", "training", {"total_steps": 8}))
    reporter.on_metrics({"step": 5, "total_steps": 8, "loss": 2.5, "tokens_per_s": 900.0, "eta_s": 12.0})
    reporter.progress.flush()
    with reporter.progress.ctx.sessions() as session:
        assert jobstate.transition(session, job_id, "succeeded", expect=("running",), fence=1)

    job = _follow_with_progress(client, job_id, timeout_s=60)
    assert job["status"] == "succeeded"
    lines = capsys.readouterr().out.splitlines()
    assert "  stage: preparing data" in lines and "  stage: training" in lines
    assert "  status: job succeeded" in lines
    assert lines[-1].endswith("] succeeded  5/8 steps (62%) | loss 2.5000"), lines


def test_the_demo_gives_up_after_its_timeout(running_job, capsys: pytest.CaptureFixture[str]) -> None:
    client, job_id, _ = running_job
    with pytest.raises(typer.Exit) as exit_:
        _follow_with_progress(client, job_id, timeout_s=0)
    assert exit_.value.exit_code == 1
    err = capsys.readouterr().err
    assert err.strip() == f"error: job {job_id} did not finish within 0s; it keeps running on the server"
    assert client.get_job(job_id)["status"] == "running"


def test_a_demo_that_started_its_server_says_the_job_is_handed_back(
    running_job, capsys: pytest.CaptureFixture[str]
) -> None:
    client, job_id, _ = running_job
    with pytest.raises(typer.Exit):
        _follow_with_progress(client, job_id, timeout_s=0, left="stopping the server hands it back")
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith(f"job {job_id} did not finish within 0s; stopping the server hands it back")
    )


def test_without_a_timeout_the_demo_waits_for_the_end(running_job) -> None:
    from service.crud import jobstate

    client, job_id, reporter = running_job
    with reporter.progress.ctx.sessions() as session:
        assert jobstate.transition(session, job_id, "succeeded", expect=("running",), fence=1)
    assert _follow_with_progress(client, job_id, None)["status"] == "succeeded"


def test_ctrl_c_while_following_says_what_becomes_of_the_job(
    running_job, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from client.progress_bar import JobProgressBar

    def interrupted(*_args: Any, **_kw: Any) -> dict[str, Any]:
        raise KeyboardInterrupt

    client, job_id, _ = running_job
    monkeypatch.setattr(JobProgressBar, "follow", interrupted)
    with pytest.raises(typer.Exit) as exit_:
        _follow_with_progress(client, job_id, None, left="stopping the server hands it back")
    assert exit_.value.exit_code == 130
    assert (
        capsys.readouterr().err.strip()
        == f"error: stopped following job {job_id}; stopping the server hands it back"
    )
