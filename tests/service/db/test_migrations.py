"""The Alembic migrations build exactly the schema the models declare, on SQLite and Postgres."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from service.db.migrate import current_heads, script_heads, upgrade
from service.db.models import Base
from service.db.session import make_engine


def test_models_and_migrations_agree(db_url: str) -> None:
    engine = make_engine(db_url)
    try:
        with engine.connect() as conn:
            ctx = MigrationContext.configure(
                conn, opts={"compare_type": True, "compare_server_default": True}
            )
            assert compare_metadata(ctx, Base.metadata) == []
    finally:
        engine.dispose()


def test_one_head() -> None:
    # Parallel branches each add a revision; a merge that forgets to re-chain them leaves two heads.
    assert len(script_heads()) == 1


def test_upgrade_is_idempotent_and_at_head(db_url: str) -> None:
    upgrade(db_url)
    assert current_heads(db_url) == script_heads()


def test_upgrade_fresh_sqlite_from_another_cwd(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    url = f"sqlite:///{tmp_path / 'fresh.db'}"
    upgrade(url)
    assert current_heads(url) == script_heads()
