"""Keyset pagination newest first on (created_at, id): stable under concurrent inserts, no OFFSET."""

from __future__ import annotations

from typing import Any, TypeVar

from sqlalchemy import Select, and_, or_
from sqlalchemy.orm import Session

T = TypeVar("T")


def newest_first_page(
    session: Session, model: type[T], query: Select[Any], after: str | None, limit: int
) -> tuple[list[T], bool] | None:
    """One page of `query` (already filtered to a project) after the row with id `after`.

    Rows inserted while a client pages are newer than any cursor, so they never shift later pages: no
    duplicates, no gaps. Returns None when the cursor row does not exist in `query`'s scope.
    """
    created, ident = model.created_at, model.id  # type: ignore[attr-defined]
    if after is not None:
        # Looked up within the same scope, so another project's id is not a valid cursor.
        anchor = session.execute(query.with_only_columns(created).where(ident == after)).first()
        if anchor is None:
            return None
        query = query.where(or_(created < anchor[0], and_(created == anchor[0], ident < after)))
    rows = list(session.scalars(query.order_by(created.desc(), ident.desc()).limit(limit + 1)))
    return rows[:limit], len(rows) > limit
