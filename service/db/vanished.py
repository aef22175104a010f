"""A row this request read that another request deleted before it wrote or re-read it: `RowVanished`
(the API answers it as the 404 a later request gets), raised by `reread` and by deletes that found
nothing, instead of SQLAlchemy's refresh errors."""

from __future__ import annotations

from typing import TypeVar

from sqlalchemy import inspect
from sqlalchemy.orm import Session

T = TypeVar("T")


class RowVanished(Exception):
    """The `kind` row `ident` was deleted by a concurrent request."""

    def __init__(self, kind: str, ident: str):
        super().__init__(f"{kind} {ident} was deleted meanwhile")
        self.kind, self.ident = kind, ident


def reread(session: Session, row: T, kind: str) -> T:
    """`row` with its columns read again (a concurrent request may have changed them); RowVanished when
    it was deleted meanwhile. Unlike `Session.refresh`, a missing row is this error, never a 500."""
    identity = inspect(row).identity
    fresh = session.get(type(row), identity, populate_existing=True) if identity else None
    if fresh is None:
        raise RowVanished(kind, str(identity[0] if identity else "?"))
    return fresh
