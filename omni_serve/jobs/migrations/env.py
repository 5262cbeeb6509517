"""Alembic's environment for the job store: runs the migrations on the connection ``JobStore.open`` passes.

Contract: ``JobStore.open`` puts an open connection, already inside its transaction (and, on PostgreSQL, holding
the migration lock), in ``config.attributes["connection"]``; the migrations run in that transaction, so Alembic
neither begins nor commits one of its own. Run from the ``alembic`` command line instead (a developer writing a new
migration), it connects to the config's ``sqlalchemy.url``.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context

from omni_serve.jobs.models import metadata


def _run(connection: sa.Connection) -> None:
    context.configure(connection=connection, target_metadata=metadata, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


def main() -> None:
    given = context.config.attributes.get("connection")
    if given is not None:
        _run(given)
        return
    engine = sa.create_engine(context.config.get_main_option("sqlalchemy.url"), poolclass=sa.pool.NullPool)
    with engine.connect() as connection:
        _run(connection)


if context.is_offline_mode():
    raise RuntimeError("the job store's migrations run online only (JobStore.open)")
main()
