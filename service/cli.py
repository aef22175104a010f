"""The server side of `peagle`: `api` (uvicorn), `db upgrade` (Alembic), `keys create|list|revoke|rotate`
and `projects list|set` (per-project limits)."""

from __future__ import annotations

from typing import Annotated

import typer

db_app = typer.Typer(no_args_is_help=True, help="Database schema management.")
keys_app = typer.Typer(no_args_is_help=True, help="API keys.")
projects_app = typer.Typer(no_args_is_help=True, help="Projects and their limits.")

_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def _size(text: str) -> int | None:
    """`10G`, `500M`, `1048576` -> bytes; `none` -> None (no cap)."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    if t in ("NONE", "UNLIMITED"):
        return None
    unit = t[-1] if t and t[-1] in _SIZE_UNITS else ""
    try:
        value = float(t[: len(t) - len(unit)])
    except ValueError:
        raise typer.BadParameter(f"{text!r} is not a size such as 500M, 10G or none") from None
    if value < 0:
        raise typer.BadParameter("a size cannot be negative")
    return int(value * _SIZE_UNITS[unit])


def api(
    host: Annotated[str, typer.Option(help="Interface to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8000,
    workers: Annotated[int, typer.Option(min=1, help="uvicorn worker processes.")] = 1,
    log_level: Annotated[str, typer.Option(help="uvicorn log level.")] = "info",
) -> None:
    """Serve the REST API with uvicorn (settings from PEAGLE_* environment variables)."""
    import uvicorn

    from service.http_server import server_options

    uvicorn.run(
        "service.app:create_app",
        factory=True,
        host=host,
        port=port,
        workers=workers,
        log_level=log_level,
        **server_options(),
    )


@db_app.command("upgrade")
def db_upgrade(
    revision: Annotated[str, typer.Argument(help="Target revision.")] = "head",
    database_url: Annotated[str | None, typer.Option(help="Override PEAGLE_DATABASE_URL.")] = None,
) -> None:
    """Apply the Alembic migrations to the configured database."""
    from service.db.migrate import upgrade
    from service.settings import get_settings

    url = database_url or get_settings().database_url
    upgrade(url, revision)
    typer.echo(f"database at {revision}")


@keys_app.command("create")
def keys_create(
    project: Annotated[str, typer.Option(help="Project name (created if it does not exist).")],
) -> None:
    """Create an API key for PROJECT and print it (it is shown only once)."""
    from service.crud.projects import create_key
    from service.db.session import session_scope
    from service.settings import get_settings

    with session_scope(get_settings().database_url) as session:
        key, row = create_key(session, project)
        typer.echo(key)
        typer.secho(
            f"project {project} ({row.project_id}); store this key now, it is not shown again", err=True
        )


@keys_app.command("list")
def keys_list(
    project: Annotated[str | None, typer.Option(help="Only this project's keys.")] = None,
) -> None:
    """List API keys: id, project, prefix, created, revoked (keys themselves are never stored)."""
    from service.crud.projects import list_keys
    from service.db.session import session_scope
    from service.settings import get_settings

    with session_scope(get_settings().database_url) as session:
        for row, name in list_keys(session, project):
            revoked = row.revoked_at.isoformat(timespec="seconds") if row.revoked_at else "-"
            created = row.created_at.isoformat(timespec="seconds")
            typer.echo(f"{row.id}\t{name}\t{row.prefix}...\t{created}\trevoked={revoked}")


@keys_app.command("revoke")
def keys_revoke(key_id: Annotated[str, typer.Argument(help="Key id (from `peagle keys list`).")]) -> None:
    """Revoke a key: requests with it get 401 from the next one on."""
    from service.crud.projects import revoke_key
    from service.db.session import session_scope
    from service.settings import get_settings

    with session_scope(get_settings().database_url) as session:
        if revoke_key(session, key_id) is None:
            typer.secho(f"no API key with id {key_id!r}", err=True)
            raise typer.Exit(1)
        session.commit()
    typer.echo(f"revoked {key_id}")


@keys_app.command("rotate")
def keys_rotate(key_id: Annotated[str, typer.Argument(help="Key id (from `peagle keys list`).")]) -> None:
    """Issue a new key for the same project and revoke KEY_ID at once; prints the new key."""
    from service.crud.projects import rotate_key
    from service.db.session import session_scope
    from service.settings import get_settings

    with session_scope(get_settings().database_url) as session:
        rotated = rotate_key(session, key_id)
        if rotated is None:
            typer.secho(f"no live API key with id {key_id!r}", err=True)
            raise typer.Exit(1)
        typer.echo(rotated[0])
        typer.secho(f"new key {rotated[1].id}; {key_id} is revoked; store the new key now", err=True)


@projects_app.command("list")
def projects_list() -> None:
    """Every project with its limits and what it uses: queues, running jobs, storage."""
    from service.crud.limits import storage_used, unfinished_job_count
    from service.crud.projects import list_projects
    from service.db.session import session_scope
    from service.settings import get_settings

    with session_scope(get_settings().database_url) as session:
        for p in list_projects(session):
            queues = ",".join(p.allowed_queues) if p.allowed_queues is not None else "any"
            running = f"{unfinished_job_count(session, p.id)}/{p.max_running_jobs or 'unlimited'}"
            storage = f"{storage_used(session, p.id)}/{p.storage_cap_bytes or 'unlimited'}"
            typer.echo(f"{p.name}\t{p.id}\tqueues={queues}\tjobs={running}\tstorage={storage}")


@projects_app.command("set")
def projects_set(
    project: Annotated[str, typer.Argument(help="Project name.")],
    queues: Annotated[
        str | None, typer.Option(help="Comma-separated queues it may use (resources.queue); 'any' for all.")
    ] = None,
    max_running_jobs: Annotated[
        str | None, typer.Option(help="Most jobs queued or running at once; 'none' for no limit.")
    ] = None,
    storage_cap: Annotated[
        str | None, typer.Option(help="Storage cap for datasets and checkpoints (500M, 10G); 'none'.")
    ] = None,
) -> None:
    """Set PROJECT's limits; options left out keep their value. Beyond a limit the API answers 403 or 429
    naming it."""
    from service.crud.limits import set_limits
    from service.crud.projects import project_by_name
    from service.db.session import session_scope
    from service.settings import get_settings

    changes: dict[str, object] = {}
    if queues is not None:
        names = [q.strip() for q in queues.split(",") if q.strip()]
        changes["allowed_queues"] = None if names == ["any"] else names
    if max_running_jobs is not None:
        value = max_running_jobs.strip().lower()
        if value not in ("none", "unlimited") and not (value.isdigit() and int(value) >= 1):
            raise typer.BadParameter("--max-running-jobs takes an integer >= 1 or none")
        changes["max_running_jobs"] = None if not value.isdigit() else int(value)
    if storage_cap is not None:
        changes["storage_cap_bytes"] = _size(storage_cap)
    with session_scope(get_settings().database_url) as session:
        row = project_by_name(session, project)
        if row is None:
            typer.secho(f"no project named {project!r}", err=True)
            raise typer.Exit(1)
        set_limits(session, row, **changes)  # type: ignore[arg-type]
        typer.echo(
            f"{project}: queues={'any' if row.allowed_queues is None else row.allowed_queues} "
            f"max_running_jobs={row.max_running_jobs} "
            f"storage_cap_bytes={row.storage_cap_bytes}"
        )


def register(app: typer.Typer) -> None:
    """Add this module's commands to `app`."""
    app.command("api")(api)
    app.add_typer(db_app, name="db")
    app.add_typer(keys_app, name="keys")
    app.add_typer(projects_app, name="projects")
