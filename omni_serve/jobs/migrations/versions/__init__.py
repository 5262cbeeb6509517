"""The job store's schema versions, oldest first by ``down_revision`` (Alembic skips this file)."""
