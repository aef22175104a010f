"""Alembic environment and versions for the peagle database (batch mode so SQLite can alter tables)."""
