"""Run Alembic migrations programmatically (`peagle db upgrade`), from any cwd and in an installed package."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config

import migrations


def alembic_config(database_url: str) -> Config:
    """An Alembic Config pointing at the packaged migrations/ directory and `database_url`."""
    # __path__, not __file__: an editable install may expose migrations/ as a namespace package.
    script_dir = Path(next(iter(migrations.__path__))).resolve()
    cfg = Config()
    cfg.set_main_option("script_location", str(script_dir))
    # `%` is ConfigParser interpolation syntax; URLs with escaped passwords contain it.
    cfg.set_main_option("sqlalchemy.url", database_url.replace("%", "%%"))
    return cfg


def upgrade(database_url: str, revision: str = "head") -> None:
    """Bring the database at `database_url` up to `revision`."""
    command.upgrade(alembic_config(database_url), revision)


def script_heads() -> set[str]:
    """The head revisions of the packaged migration scripts (what `upgrade` brings a database to)."""
    from alembic.script import ScriptDirectory

    return set(ScriptDirectory.from_config(alembic_config("sqlite://")).get_heads())


def current_heads(database_url: str) -> set[str]:
    """The revisions the database is at (empty when never migrated)."""
    from alembic.runtime.migration import MigrationContext

    from service.db.session import make_engine

    engine = make_engine(database_url)
    try:
        with engine.connect() as conn:
            return set(MigrationContext.configure(conn).get_current_heads())
    finally:
        engine.dispose()
