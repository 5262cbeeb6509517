"""Alembic migrations of the job store's schema (``env.py``, ``versions/``), applied by ``JobStore.open``.

Contract: one file per schema version under ``versions/``, each with the ``revision`` of the one before as its
``down_revision``; an applied migration is never edited, a schema change is a new file (``alembic revision`` with
``script_location`` set to this directory writes one from ``script.py.mako``). This is a package only so that
installs carry the files; nothing imports it but Alembic.
"""
