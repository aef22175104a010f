"""The server side of `peagle`: `api` (uvicorn), `db upgrade` (Alembic) and `keys create|list|revoke|rotate`."""

from __future__ import annotations

from typing import Annotated

import typer

db_app = typer.Typer(no_args_is_help=True, help="Database schema management.")
keys_app = typer.Typer(no_args_is_help=True, help="API keys.")


def api(
    host: Annotated[str, typer.Option(help="Interface to bind.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8000,
    workers: Annotated[int, typer.Option(min=1, help="uvicorn worker processes.")] = 1,
    log_level: Annotated[str, typer.Option(help="uvicorn log level.")] = "info",
) -> None:
    """Serve the REST API with uvicorn (settings from PEAGLE_* environment variables)."""
    import uvicorn

    uvicorn.run(
        "service.app:create_app",
        factory=True,
        host=host,
        port=port,
        workers=workers,
        log_level=log_level,
        proxy_headers=True,
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


def register(app: typer.Typer) -> None:
    """Add this module's commands to `app`."""
    app.command("api")(api)
    app.add_typer(db_app, name="db")
    app.add_typer(keys_app, name="keys")
