"""The job record: the ``jobs`` table (SQLAlchemy Core) and ``Job``, the immutable snapshot the store hands out.

Contract: ``JOBS`` describes the table as the newest migration (``migrations/versions``) leaves it; a change to it
comes with a new migration, never an edit of an applied one. Times are unix seconds (floats in the table; ``Job``
gives OpenAI's whole seconds for ``created_at``, ``completed_at`` and ``expires_at``). A job's ``status`` is one of
``STATUSES``; ``queued`` and ``in_progress`` are the ``ACTIVE`` ones (counted against an owner's queue limit).
Job ids are ``<object>_<32 hex digits>``: microseconds since the epoch, then random digits, so their string order
is creation order (the order ``JobStore.list`` pages in, cursor ``after`` an id).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

QUEUED, IN_PROGRESS, COMPLETED, FAILED = "queued", "in_progress", "completed", "failed"
STATUSES = (QUEUED, IN_PROGRESS, COMPLETED, FAILED)
ACTIVE = (QUEUED, IN_PROGRESS)
#: The ``object`` of every job (OpenAI's video object) and the prefix of its id.
OBJECT = "video"

metadata = sa.MetaData()


def id_type() -> sa.types.TypeEngine:
    """Job ids: compared bytewise on PostgreSQL too (collation "C"), so their order is the same on both backends."""
    return sa.String(64).with_variant(sa.String(64, collation="C"), "postgresql")


JOBS = sa.Table(
    "jobs", metadata,
    sa.Column("id", id_type(), primary_key=True),
    sa.Column("kind", sa.String(128), nullable=False),
    sa.Column("owner", sa.String(256), nullable=False),
    sa.Column("status", sa.String(16), nullable=False),
    sa.Column("progress", sa.Integer, nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("completed_at", sa.Float),
    sa.Column("expires_at", sa.Float),
    sa.Column("error", sa.JSON),
    sa.Column("request", sa.JSON, nullable=False),
    sa.Column("attempts", sa.Integer, nullable=False),
    sa.Column("worker", sa.String(256)),
    sa.Column("lease_until", sa.Float),
    sa.Column("result_file", sa.String(512)),
    sa.Index("ix_jobs_owner_id", "owner", "id"),
    sa.Index("ix_jobs_status_id", "status", "id"),
    sa.Index("ix_jobs_status_lease_until", "status", "lease_until"),
    sa.Index("ix_jobs_expires_at", "expires_at"),
)


@dataclass(frozen=True, kw_only=True)
class Job:
    """One job as the store last saw it (a copy: changing the job goes through ``JobStore``).

    ``status`` is ``queued``, ``in_progress``, ``completed`` or ``failed``; ``progress`` 0-100, never lower than
    before; ``completed_at`` is set when the job finished (completed or failed), ``expires_at`` then too: past it
    ``JobStore.expire`` deletes the record and its result. ``error`` is an OpenAI error object (``code``,
    ``message``) of a failed job. ``attempts`` counts the claims so far; ``worker`` and ``lease_until`` name the
    worker holding (or that last held) the job and until when its lease runs. ``result_file`` is the result's path
    relative to the store's results directory (``JobStore.result_path`` gives the full path).
    """

    id: str
    kind: str
    owner: str
    status: str
    progress: int
    created_at: int
    completed_at: int | None
    expires_at: int | None
    error: dict[str, Any] | None
    request: dict[str, Any]
    attempts: int
    worker: str | None
    lease_until: float | None
    result_file: str | None
    object: str = OBJECT

    @classmethod
    def from_row(cls, row: Any) -> Job:
        """The snapshot of a ``JOBS`` row (a SQLAlchemy ``Row`` or mapping)."""
        m = row._mapping if hasattr(row, "_mapping") else row
        return cls(id=m["id"], kind=m["kind"], owner=m["owner"], status=m["status"], progress=m["progress"],
                   created_at=int(m["created_at"]), completed_at=_whole(m["completed_at"]),
                   expires_at=_whole(m["expires_at"]), error=m["error"], request=m["request"],
                   attempts=m["attempts"], worker=m["worker"], lease_until=m["lease_until"],
                   result_file=m["result_file"])


def _whole(t: float | None) -> int | None:
    return None if t is None else int(t)
