"""The `peagle` client commands and SDK against a real API server (uvicorn on a local port).

Errors come out as one line with a non-zero exit; checkpoint downloads resume through Range and
verify every file's sha256.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from typer.testing import CliRunner

from cli import build_app
from client import PeagleClient
from tests.fixtures.stack import serve_app

DATASET_ROWS = [
    {
        "messages": [
            {"role": "user", "content": f"question {i}"},
            {"role": "assistant", "content": f"answer {i}"},
        ]
    }
    for i in range(5)
]


@pytest.fixture
def server_url(app: Any, redis_conn: Any) -> Iterator[str]:
    """The app served by uvicorn in a thread on a free port."""
    with serve_app(app) as url:
        yield url


@pytest.fixture
def peagle(server_url: str, api_key: str, tmp_path: Path):
    """Run `peagle ...` in-process against the server; returns (exit code, stdout, stderr)."""
    runner = CliRunner()
    # An empty PEAGLE_DATA_DIR: no key file from a real `peagle up` may leak into the test.
    env = {"PEAGLE_URL": server_url, "PEAGLE_API_KEY": api_key, "PEAGLE_DATA_DIR": str(tmp_path / "nodata")}

    def run(*args: str, key: str | None = None) -> tuple[int, str, str]:
        result = runner.invoke(
            build_app(), list(args), env={**env, **({"PEAGLE_API_KEY": key} if key else {})}
        )
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            raise result.exception
        return result.exit_code, result.stdout, result.stderr

    return run


@pytest.fixture
def dataset_file(tmp_path: Path) -> Path:
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in DATASET_ROWS))
    return path


def write_spec(path: Path, settings: Any, dataset_id: str, **training: Any) -> Path:
    verifier = Path(settings.allowed_model_roots[0]) / "verifier"
    verifier.mkdir(exist_ok=True)
    spec = {
        "verifier": {"name_or_path": str(verifier)},
        "dataset": {"id": dataset_id, "seq_len": 64},
        "training": {"total_seq_len": 256, **training},
    }
    path.write_text(yaml.safe_dump(spec))
    return path


def one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one error line, got:\n{stderr}"
    assert lines[0].startswith("error: ")
    assert "Traceback" not in stderr
    return lines[0]


def test_upload_submit_list_get_logs_cancel(
    peagle, dataset_file: Path, settings: Any, tmp_path: Path
) -> None:
    code, out, _ = peagle("datasets", "upload", str(dataset_file))
    assert code == 0
    dataset_id = out.strip()
    assert dataset_id.startswith("ds_")
    code, out, _ = peagle("datasets", "list")
    assert code == 0 and dataset_id in out

    spec = write_spec(tmp_path / "job.yaml", settings, dataset_id, max_steps=3)
    code, out, err = peagle("jobs", "submit", str(spec))
    assert code == 0, err
    job_id = out.strip()
    assert job_id.startswith("job_")

    code, out, _ = peagle("jobs", "list")
    assert code == 0 and job_id in out and "queued" in out
    code, out, _ = peagle("jobs", "get", job_id)
    job = json.loads(out)
    assert job["status"] == "queued"
    assert job["spec"]["training"]["max_steps"] == 3
    assert job["spec"]["dataset"]["id"] == dataset_id

    code, out, _ = peagle("jobs", "cancel", job_id)
    assert code == 0 and out.strip() == f"{job_id}: cancelled"
    code, out, _ = peagle("jobs", "logs", job_id)
    assert code == 0
    assert "cancelled" in out
    # Following a finished job prints its events and ends; a cancelled job exits non-zero.
    code, out, err = peagle("jobs", "logs", job_id, "--follow")
    assert code == 1 and f"{job_id}: cancelled" in out
    assert one_error_line(err) == f"error: job {job_id} cancelled"


def test_sdk_iterates_every_job_across_pages(
    server_url: str, api_key: str, dataset_file: Path, settings: Any, tmp_path: Path
) -> None:
    with PeagleClient(server_url, api_key) as client:
        dataset_id = client.upload_dataset(dataset_file)["id"]
        spec = yaml.safe_load(write_spec(tmp_path / "job.yaml", settings, dataset_id).read_text())
        created = [client.create_job(spec)["id"] for _ in range(5)]
        client.cancel_job(created[0])
        seen = [job["id"] for job in client.iter_jobs(page_size=2)]
        assert sorted(seen) == sorted(created) and len(seen) == 5  # three pages, nothing twice
        assert [job["id"] for job in client.iter_jobs(status="cancelled", page_size=2)] == [created[0]]


def test_errors_print_one_line_and_exit_nonzero(
    peagle, dataset_file: Path, settings: Any, tmp_path: Path, other_api_key: str
) -> None:
    code, _, err = peagle("jobs", "get", "job_doesnotexist")
    assert code == 1
    assert "job_doesnotexist" in one_error_line(err) and "not_found]" in err

    code, _, err = peagle("jobs", "list", key="peagle_sk_not-a-real-key")
    assert code == 1
    assert "invalid or revoked API key" in one_error_line(err)

    # Validated locally: the message names the field and the exit is non-zero before any request.
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        yaml.safe_dump(
            {"verifier": {"name_or_path": "/x"}, "dataset": {"id": "ds_x"}, "training": {"lr": -1}}
        )
    )
    code, _, err = peagle("jobs", "submit", str(bad))
    assert code == 1
    assert "training.lr" in one_error_line(err)
    broken = tmp_path / "broken.yaml"
    broken.write_text("verifier:\n  name_or_path: [unclosed\n")
    code, _, err = peagle("jobs", "submit", str(broken))
    assert code == 1 and "line" in one_error_line(err)

    # Valid locally, refused by the server: its message (naming the field) is what the user sees.
    code, out, _ = peagle("datasets", "upload", str(dataset_file))
    outside = tmp_path / "outside.yaml"
    spec = yaml.safe_load(write_spec(tmp_path / "ok.yaml", settings, out.strip()).read_text())
    spec["verifier"]["name_or_path"] = str(tmp_path / "elsewhere")
    outside.write_text(yaml.safe_dump(spec))
    code, _, err = peagle("jobs", "submit", str(outside))
    assert code == 1
    assert "spec.verifier.name_or_path" in one_error_line(err) or "allowed roots" in err

    # Another project's job is invisible (404), not forbidden.
    code, out, _ = peagle("jobs", "submit", str(tmp_path / "ok.yaml"))
    job_id = out.strip()
    code, _, err = peagle("jobs", "get", job_id, key=other_api_key)
    assert code == 1 and "not_found]" in one_error_line(err)


def test_bad_key_from_the_console_script_has_no_traceback(server_url: str, tmp_path: Path) -> None:
    env = {
        **os.environ,
        "PEAGLE_URL": server_url,
        "PEAGLE_API_KEY": "peagle_sk_wrong",
        "PEAGLE_DATA_DIR": str(tmp_path),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "cli", "jobs", "list"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert "invalid or revoked API key" in one_error_line(proc.stderr)
    assert proc.stdout == ""


# -- checkpoint download -----------------------------------------------------------------------


@pytest.fixture
def published_checkpoint(peagle, dataset_file: Path, settings: Any, tmp_path: Path) -> dict[str, Any]:
    """A checkpoint published the way the worker does it: files under a key, then the DB row."""
    from service.artifacts import ArtifactStore
    from service.crud.checkpoints import add_checkpoint
    from service.crud.jobs import find_job
    from service.db.models import new_id
    from service.db.session import session_scope

    _, out, _ = peagle("datasets", "upload", str(dataset_file))
    _, out, _ = peagle("jobs", "submit", str(write_spec(tmp_path / "job.yaml", settings, out.strip())))
    job_id = out.strip()
    src = tmp_path / "export"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"speculators_model_type": "peagle"}))
    (src / "model.safetensors").write_bytes(os.urandom(3 * (1 << 20) + 123))
    store = ArtifactStore(settings.artifact_root)
    ckpt_id = new_id("ckpt")
    uri = f"checkpoints/{ckpt_id}"
    files = store.publish_dir(src, uri)
    with session_scope(settings.database_url) as session:
        project_id = find_job(session, job_id).project_id
        add_checkpoint(
            session, checkpoint_id=ckpt_id, job_id=job_id, project_id=project_id, step=7, uri=uri, files=files
        )
    return {"id": ckpt_id, "job_id": job_id, "src": src, "store": store, "uri": uri}


def test_download_resumes_through_range(
    server_url: str, api_key: str, published_checkpoint: dict, tmp_path: Path
) -> None:
    src: Path = published_checkpoint["src"]
    data = (src / "model.safetensors").read_bytes()
    out = tmp_path / "dl"
    out.mkdir()
    have = len(data) // 3
    (out / "model.safetensors.part").write_bytes(data[:have])  # an interrupted earlier download

    seen: list[tuple[int, str | None]] = []
    http = httpx.Client(
        base_url=server_url,
        event_hooks={"response": [lambda r: seen.append((r.status_code, r.request.headers.get("range")))]},
    )
    with PeagleClient(server_url, api_key, http=http) as client:
        ckpt = client.list_checkpoints(published_checkpoint["job_id"])["data"][0]
        assert ckpt["id"] == published_checkpoint["id"] and ckpt["step"] == 7
        received = []
        client.download_checkpoint(ckpt["id"], out, on_bytes=received.append)

    assert (out / "model.safetensors").read_bytes() == data
    assert (out / "config.json").read_bytes() == (src / "config.json").read_bytes()
    assert not (out / "model.safetensors.part").exists()
    assert (206, f"bytes={have}-") in seen
    # Only the missing bytes crossed the wire (plus the config file).
    assert sum(received) == len(data) + (src / "config.json").stat().st_size


def test_download_discards_a_corrupt_partial_and_verifies(
    peagle, published_checkpoint: dict, tmp_path: Path
) -> None:
    data = (published_checkpoint["src"] / "model.safetensors").read_bytes()
    out = tmp_path / "dl"
    out.mkdir()
    (out / "model.safetensors.part").write_bytes(b"\0" * 1000)  # wrong bytes: resuming would corrupt
    code, stdout, err = peagle("checkpoints", "download", published_checkpoint["id"], "--out", str(out))
    assert code == 0, err
    assert (out / "model.safetensors").read_bytes() == data

    code, stdout, _ = peagle("checkpoints", "list", published_checkpoint["job_id"])
    assert code == 0 and published_checkpoint["id"] in stdout
    assert "servable" in stdout and "unverified" in stdout  # published without the vLLM gate


def test_download_refuses_bytes_that_do_not_match_the_published_sha256(
    peagle, published_checkpoint: dict, tmp_path: Path
) -> None:
    store = published_checkpoint["store"]
    stored = store.local_path(f"{published_checkpoint['uri']}/model.safetensors")
    raw = bytearray(stored.read_bytes())
    raw[100] ^= 0xFF  # bit rot on the server: same size, different bytes
    stored.write_bytes(bytes(raw))
    out = tmp_path / "dl"
    code, _, err = peagle("checkpoints", "download", published_checkpoint["id"], "--out", str(out))
    assert code == 1
    assert "model.safetensors" in one_error_line(err) and "sha256" in err
    assert not (out / "model.safetensors").exists()


# -- live progress -------------------------------------------------------------------------------


def test_progress_bar_follows_a_job_through_the_api(
    peagle, server_url: str, api_key: str, dataset_file: Path, settings: Any, tmp_path: Path
) -> None:
    """The worker's own reporter writes a job's progress stage by stage; the bar, polling the API with no
    terminal, prints plain lines with the stage, step/total, tokens/s, loss and ETA, and the speed-up timing's
    rounds with their count; `peagle jobs logs -f` prints the same bar under the events, and on a terminal
    the bar is drawn instead."""
    from rich.console import Console

    from client.progress_bar import JobProgressBar
    from peagle_core.events import Event
    from service.crud import jobstate
    from service.db.session import session_factory
    from worker.attempt import AttemptContext
    from worker.job_io import JobReporter
    from worker.progress import ProgressWriter

    _, out, _ = peagle("datasets", "upload", str(dataset_file))
    _, out, _ = peagle("jobs", "submit", str(write_spec(tmp_path / "job.yaml", settings, out.strip())))
    job_id = out.strip()
    sessions = session_factory(settings.database_url)
    with sessions() as session:
        assert jobstate.claim(session, job_id, "w1")
    writer = ProgressWriter(AttemptContext(sessions, job_id, 1))  # not started: flush() writes right here
    reporter = JobReporter(writer, on_stage=writer.set_stage)
    step = {"step": 3, "total_steps": 8, "loss": 2.5, "tokens_per_s": 1234.0, "eta_s": 75.0, "lr": 1e-3}

    def succeed() -> None:
        with sessions() as session:
            assert jobstate.transition(session, job_id, "succeeded", expect=("running",), fence=1)

    # One stage per poll of the bar, so that it sees each of them.
    script = [
        lambda: reporter.on_event(Event("prepare", "preparing data")),
        lambda: reporter.on_event(Event("hidden_states", "hidden states: offline")),
        lambda: reporter.on_event(
            Event.log("hidden_states", "building the cache", done=0, total=4000, unit="tokens")
        ),
        lambda: reporter.on_event(
            Event.log("hidden_states", "building the cache", done=1000, total=4000, unit="tokens")
        ),
        lambda: reporter.on_event(Event("train", "training", {"total_steps": 8})),
        lambda: reporter.on_metrics(step),
        lambda: reporter.on_event(Event("export", "exporting the drafter")),
        lambda: reporter.on_event(Event.log("serving", "timing drafter K=2 round 1/3", done=0, total=12)),
        lambda: reporter.on_event(Event.log("serving", "timing drafter K=2 round 2/3", done=1, total=12)),
        succeed,
    ]

    def next_stage(_job: dict[str, Any]) -> None:
        if script:
            script.pop(0)()
            writer.flush()

    plain = Console(file=io.StringIO(), width=200)
    with PeagleClient(server_url, api_key) as client, JobProgressBar(plain, every_s=0) as bar:
        assert not bar.live  # a file is no terminal
        job = bar.follow(client, job_id, show=lambda _: None, on_job=next_stage, poll_s=0.01)
    assert job["status"] == "succeeded" and not script
    lines = plain.file.getvalue().splitlines()  # type: ignore[attr-defined]
    assert any(line.endswith("] prepare: preparing data") for line in lines), lines
    # The cache build's count, in its unit, and an ETA from its pace.
    assert any(line.endswith("] hidden_states: building the cache  0/4000 tokens (0%)") for line in lines), (
        lines
    )
    assert any(
        "] hidden_states: building the cache  1000/4000 tokens (25%) | eta " in line for line in lines
    ), lines
    assert any(line.endswith("] train  0/8 steps (0%)") for line in lines), (
        lines
    )  # announced, not yet stepped
    assert any(
        line.endswith("] train  3/8 steps (38%) | 1,234 tok/s | loss 2.5000 | eta 1m15s") for line in lines
    ), lines
    assert any(line.endswith("] export: timing drafter K=2 round 1/3  0/12 (0%)") for line in lines), lines
    # The second round has a pace, hence an ETA.
    assert any("] export: timing drafter K=2 round 2/3  1/12 (8%) | eta " in line for line in lines), lines
    assert lines[-1].endswith("] succeeded  3/8 steps (38%) | loss 2.5000"), lines
    assert "\x1b" not in plain.file.getvalue()  # type: ignore[attr-defined]  # plain lines, no redrawing

    code, out, err = peagle("jobs", "logs", job_id, "--follow")
    assert code == 0, err
    assert "timing drafter K=2 round 2/3 (1/12)" in out  # the event itself, with its count
    assert "building the cache (1,000/4,000 tokens)" in out
    assert "] succeeded  3/8 steps (38%) | loss 2.5000" in out  # the bar's last line
    assert out.rstrip().endswith(f"{job_id}: succeeded")

    drawn = Console(file=io.StringIO(), width=160, force_terminal=True, color_system=None)
    with PeagleClient(server_url, api_key) as client, JobProgressBar(drawn) as bar:
        assert bar.live
        bar.job(client.get_job(job_id))
    screen = drawn.file.getvalue()  # type: ignore[attr-defined]
    assert "succeeded" in screen and "3/8 | loss 2.5000" in screen and "━" in screen
