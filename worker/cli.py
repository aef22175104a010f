"""`peagle worker` and `peagle reconcile`."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Add the worker commands to `app`."""
