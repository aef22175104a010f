"""`peagle train` and `peagle eval`: top-level training and evaluation commands."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Add the `train` and `eval` commands to `app`."""
