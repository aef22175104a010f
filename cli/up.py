"""`peagle up`: the whole service on one machine with nothing installed (see cli/embedded.py)."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Annotated

import typer

from peagle_core.cli.common import fail
from peagle_core.torch_builds import require_matching_companions


def register(app: typer.Typer) -> None:
    """Add `peagle up` to `app`."""
    app.command("up")(up)


def up(
    data_dir: Annotated[
        Path,
        typer.Option(envvar="PEAGLE_DATA_DIR", help="Where the database, artifacts, logs and API key live."),
    ] = Path("./peagle-data"),
    host: Annotated[str, typer.Option(help="Interface the API listens on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="API port.")] = 8000,
) -> None:
    """Run API + worker + SQLite + embedded Redis + reconciler until Ctrl-C; run again to continue."""
    from cli.embedded import EmbeddedStack, StackError

    require_matching_companions()  # before anything starts: the worker could not train
    stack = EmbeddedStack(data_dir=data_dir, host=host, port=port)
    # Ctrl-C and SIGTERM only ask the supervisor loop to end; the orderly stop happens below.
    signal.signal(signal.SIGINT, stack.request_stop)
    signal.signal(signal.SIGTERM, stack.request_stop)
    try:
        typer.echo("starting peagle (SQLite + embedded Redis + API + worker)…", err=True)
        stack.start()
        typer.echo(f"peagle is up at {stack.url}")
        typer.echo(f"API key:   {stack.api_key}")
        typer.echo(f"data dir:  {stack.data_dir}  (logs in {stack.data_dir / 'logs'})")
        typer.echo(f"files:     {stack.files_dir}  (server paths for dataset.path / cache_uri)")
        typer.echo("try:       peagle demo   |   peagle jobs list   (Ctrl-C stops everything)", err=True)
        stack.run_until_stopped()
    except StackError as exc:
        stack.stop()
        fail(exc.message)
    except BaseException:
        stack.stop()
        raise
    typer.echo("stopping: the worker checkpoints its job, then the API and Redis stop…", err=True)
    codes = stack.stop()
    typer.echo(f"stopped ({', '.join(f'{name} {_how(code)}' for name, code in codes.items())})", err=True)


def _how(code: int | None) -> str:
    # uvicorn re-raises the signal it handled, so a clean API stop reads as "ended by SIGTERM".
    if code is not None and code < 0:
        return f"ended by {signal.Signals(-code).name}"
    return f"exit {code}"
