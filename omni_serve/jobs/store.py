"""``JobStore``: asynchronous jobs (the Videos API's) kept in a database, their results as files.

Contract: every method is synchronous (SQLAlchemy's sync engine, a pool of connections) and safe to call from
several threads at once; callers on an event loop wrap each call in ``asyncio.to_thread``. Every state change is
one database transaction, so any number of stores (processes, replicas) may share one database: PostgreSQL for
several nodes, a SQLite file for one. A job is created ``queued``; a worker ``claim``s it (``in_progress``, under a
lease it renews with ``heartbeat``/``progress``) and ends it with ``complete`` (a result file) or ``fail``. A job
whose lease runs out (its worker died) is queued again, or failed with error code ``job_lost`` once it has been
claimed ``max_attempts`` times: claims and ``reap`` do that, so a job is never left ``in_progress`` by a dead
worker. A finished job (completed or failed) expires ``result_ttl_s`` after it finished; ``expire`` deletes its
record and its files. ``sweep_orphans`` removes the folders of jobs without a record (a crash between a record's
delete and its folder's removal leaves one), only once they are ``grace_s`` old: a job's folder may be written
before its record is inserted. Owners only see their own jobs: another owner's id looks unknown.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import threading
import time
import zlib
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from typing import Any, Literal

import sqlalchemy as sa

from omni_serve.jobs.models import ACTIVE, COMPLETED, FAILED, IN_PROGRESS, JOBS, OBJECT, QUEUED, Job

MIGRATIONS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "migrations")
#: PostgreSQL advisory lock (the one-bigint key space) held by the transaction that runs the migrations.
MIGRATION_LOCK = 0x6F6D6E69_6A6F6273
#: First key of the advisory locks (two-int key space) serializing one owner's creates: the queue limit is exact.
OWNER_LOCK_SPACE = 0x6F6D6E69
LOST = "job_lost"
EXPIRE_BATCH = 500
ID_FORM = re.compile(r"[a-z]+_[0-9a-f]{32}")
NAME_FORM = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
INPUTS = "inputs"  # a job's input files: results_dir/<job id>/inputs/<name>
#: Default age (seconds since its last change) past which ``sweep_orphans`` removes a job folder without a record.
ORPHAN_GRACE_S = 3600.0


class QueueFull(Exception):
    """The owner already has ``limit`` jobs queued or in progress (the API answers 429)."""

    def __init__(self, owner: str, limit: int):
        super().__init__(f"too many jobs queued or in progress: at most {limit} at once; wait for one to finish")
        self.owner = owner
        self.limit = limit


_ids_lock = threading.Lock()
_last_us = 0


def new_id(now: float) -> str:
    """``video_`` + 14 hex digits of microseconds since the epoch (strictly increasing in this process) + 18 random
    ones: ids sort in creation order, ties between processes broken at random."""
    global _last_us
    with _ids_lock:
        _last_us = max(int(now * 1e6), _last_us + 1)
        stamp = _last_us
    return f"{OBJECT}_{stamp:014x}{secrets.token_hex(9)}"


def _sqlite_url(url: sa.URL) -> bool:
    return url.get_backend_name() == "sqlite"


def engine_url(url: str) -> sa.URL:
    """``url`` parsed; PostgreSQL always through psycopg 3 (the driver this package installs)."""
    parsed = sa.make_url(url)
    if parsed.get_backend_name() == "postgresql":
        parsed = parsed.set(drivername="postgresql+psycopg")
    elif not _sqlite_url(parsed):
        raise ValueError(f"database URL {parsed.render_as_string()!r}: only sqlite and postgresql are supported")
    elif parsed.database in (None, "", ":memory:"):
        raise ValueError("database URL: a SQLite database must be a file (sqlite:////path/file.sqlite3)")
    return parsed


class JobStore:
    """Jobs in a database (a SQLite file, or PostgreSQL shared by several replicas), results in ``results_dir``.

    Args:
        url: SQLAlchemy URL: ``sqlite:////abs/path/jobs.sqlite3`` or ``postgresql://user:pw@host/db``.
        results_dir: where result files live (``<results_dir>/<job id>/``): every replica must see it.
        result_ttl_s: seconds a finished job and its result are kept.
        lease_s: seconds a claim (or its last renewal) holds a job.
        max_attempts: claims a job may take before a lost lease fails it.
        clock: unix time in seconds (``time.time``; tests pass a fake).

    ``open()`` before use (it applies the schema's migrations), ``close()`` after. Blocking: from an event loop,
    call each method through ``asyncio.to_thread``.
    """

    def __init__(self, url: str, results_dir: str, *, result_ttl_s: float, lease_s: float, max_attempts: int,
                 clock: Callable[[], float] | None = None):
        if result_ttl_s <= 0 or lease_s <= 0 or max_attempts < 1:
            raise ValueError("result_ttl_s and lease_s must be > 0, max_attempts >= 1")
        self.url = engine_url(url)
        self.results_dir = os.path.abspath(results_dir)
        self.result_ttl_s = float(result_ttl_s)
        self.lease_s = float(lease_s)
        self.max_attempts = int(max_attempts)
        self.clock = clock or time.time
        self.sqlite = _sqlite_url(self.url)
        self._engine: sa.Engine | None = None
        self._lock = threading.Lock()

    # -- lifecycle --------------------------------------------------------------------------------------------

    def open(self) -> JobStore:
        """Connect and bring the schema to the newest migration; idempotent (a second call does nothing).

        Several processes may open one database at once: on PostgreSQL the migrating transaction first takes a
        transaction-level advisory lock (``pg_advisory_xact_lock``), so one migrates while the others wait and
        then find the schema current; PostgreSQL's DDL is transactional, so a failed migration leaves nothing
        half-done. On SQLite the transaction begins ``IMMEDIATE`` (the database's write lock), to the same end.

        Returns:
            The store itself.
        """
        with self._lock:
            if self._engine is not None:
                return self
            os.makedirs(self.results_dir, exist_ok=True)
            engine = self._create_engine()
            try:
                self._migrate(engine)
            except BaseException:
                engine.dispose()
                raise
            self._engine = engine
        return self

    def close(self) -> None:
        """Release the database connections; idempotent. The store may be opened again."""
        with self._lock:
            engine, self._engine = self._engine, None
        if engine is not None:
            engine.dispose()

    def __enter__(self) -> JobStore:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _create_engine(self) -> sa.Engine:
        if not self.sqlite:
            return sa.create_engine(self.url, pool_pre_ping=True)
        os.makedirs(os.path.dirname(os.path.abspath(self.url.database)), exist_ok=True)
        engine = sa.create_engine(self.url, connect_args={"timeout": 30, "check_same_thread": False})

        @sa.event.listens_for(engine, "connect")
        def _connect(dbapi_connection: Any, _record: Any) -> None:
            # the driver's own transaction handling off: SQLAlchemy's "begin" below emits BEGIN itself
            dbapi_connection.isolation_level = None
            cursor = dbapi_connection.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")  # readers do not wait for the writer
            cursor.close()

        @sa.event.listens_for(engine, "begin")
        def _begin(connection: sa.Connection) -> None:
            # a writing transaction takes the write lock first (IMMEDIATE): a read-then-write (claim, the queue
            # limit) cannot interleave with another writer's, and waits (timeout above) instead of failing
            deferred = connection.get_execution_options().get("omni_read_only", False)
            connection.exec_driver_sql("BEGIN" if deferred else "BEGIN IMMEDIATE")

        return engine

    def _migrate(self, engine: sa.Engine) -> None:
        from alembic import command
        from alembic.config import Config

        with engine.connect() as connection, connection.begin():
            if not self.sqlite:
                connection.execute(sa.select(sa.func.pg_advisory_xact_lock(
                    sa.cast(sa.literal(MIGRATION_LOCK), sa.BigInteger))))
            config = Config()
            config.set_main_option("script_location", MIGRATIONS)
            config.attributes["connection"] = connection
            command.upgrade(config, "head")

    @contextmanager
    def _tx(self, *, read_only: bool = False) -> Iterator[sa.Connection]:
        """One transaction (committed when the block ends without an exception)."""
        if self._engine is None:
            raise RuntimeError("JobStore used before open() or after close()")
        with self._engine.connect() as connection:
            connection.execution_options(omni_read_only=read_only)
            with connection.begin():
                yield connection

    # -- the API's side: owners ----------------------------------------------------------------------------------

    def create(self, kind: str, owner: str, request: dict[str, Any], *, max_queued: int | None,
               inputs: dict[str, bytes] | None = None) -> Job:
        """A new ``queued`` job.

        Args:
            kind: what the job runs (the worker's choice of jobs: ``claim(kinds=...)``), e.g. a model name.
            owner: who may see it (the API key's identity).
            request: the create request (JSON-serializable), handed to the worker that claims the job.
            max_queued: jobs ``owner`` may have queued or in progress at once; None: no limit.
            inputs: files the worker reads (``input_path``), by name (e.g. a reference image): written to the
                job's folder under ``results_dir`` before its record is, and deleted with it.

        Raises:
            QueueFull: ``owner`` already has ``max_queued`` jobs queued or in progress.
        """
        now = self.clock()
        job_id = new_id(now)
        folder = os.path.join(self.results_dir, job_id)
        try:
            if inputs:
                os.makedirs(os.path.join(folder, INPUTS), exist_ok=True)
                for name, data in inputs.items():
                    with open(os.path.join(folder, INPUTS, _checked_name(name)), "wb") as f:
                        f.write(data)
            with self._tx() as tx:
                if max_queued is not None:
                    if not self.sqlite:  # one owner's creates in turn: the count below stays true until commit
                        key = zlib.crc32(owner.encode()) - (1 << 31)  # an int4
                        tx.execute(sa.select(sa.func.pg_advisory_xact_lock(_int4(OWNER_LOCK_SPACE), _int4(key))))
                    active = tx.scalar(sa.select(sa.func.count()).select_from(JOBS).where(
                        JOBS.c.owner == owner, JOBS.c.status.in_(ACTIVE)))
                    if active >= max_queued:
                        raise QueueFull(owner, max_queued)
                row = dict(id=job_id, kind=kind, owner=owner, status=QUEUED, progress=0, created_at=now,
                           completed_at=None, expires_at=None, error=None, request=request, attempts=0, worker=None,
                           lease_until=None, result_file=None)
                tx.execute(JOBS.insert().values(**row))
        except BaseException:
            if inputs:
                self._remove_files(job_id)
            raise
        return Job.from_row(row)

    def input_path(self, job: Job, name: str) -> str:
        """The full path of the job's input file ``name`` (given to ``create``)."""
        return os.path.join(self.results_dir, _checked_id(job.id), INPUTS, _checked_name(name))

    def get(self, job_id: str, owner: str) -> Job | None:
        """``owner``'s job ``job_id``; None when there is none (expired, deleted, never was, or another owner's)."""
        with self._tx(read_only=True) as tx:
            row = tx.execute(JOBS.select().where(JOBS.c.id == job_id, JOBS.c.owner == owner)).first()
        return None if row is None else Job.from_row(row)

    def list(self, owner: str, *, after: str | None = None, limit: int = 20,
             order: Literal["asc", "desc"] = "desc") -> tuple[list[Job], bool]:
        """One page of ``owner``'s jobs in creation order (OpenAI's cursor pagination).

        Args:
            after: the last id of the previous page (it need not exist any more); None: the first page.
            limit: jobs per page (>= 1).
            order: ``asc``, oldest first, or ``desc``, newest first.

        Returns:
            The page and whether more jobs follow it.
        """
        if limit < 1:
            raise ValueError("limit must be >= 1")
        if order not in ("asc", "desc"):
            raise ValueError("order must be 'asc' or 'desc'")
        query = JOBS.select().where(JOBS.c.owner == owner)
        if after is not None:
            query = query.where(JOBS.c.id > after if order == "asc" else JOBS.c.id < after)
        query = query.order_by(JOBS.c.id.asc() if order == "asc" else JOBS.c.id.desc()).limit(limit + 1)
        with self._tx(read_only=True) as tx:
            rows = tx.execute(query).all()
        return [Job.from_row(r) for r in rows[:limit]], len(rows) > limit

    def delete(self, job_id: str, owner: str) -> Job | None:
        """Delete ``owner``'s job ``job_id`` (its record and its files), whatever its status.

        A worker still running it learns so from its next ``heartbeat``/``progress`` (False); its ``complete``
        then discards the file.

        Returns:
            The job as it was before the delete (the caller cancels its work when it was in progress), or None
            when ``owner`` has no such job.
        """
        with self._tx() as tx:
            row = tx.execute(JOBS.select().where(JOBS.c.id == job_id, JOBS.c.owner == owner)
                             .with_for_update()).first()
            if row is None:
                return None
            tx.execute(JOBS.delete().where(JOBS.c.id == job_id))
        self._remove_files(job_id)
        return Job.from_row(row)

    def result_path(self, job: Job) -> str | None:
        """The full path of a completed job's result file, or None (not completed, or the file is gone)."""
        if job.status != COMPLETED or not job.result_file:
            return None
        path = os.path.join(self.results_dir, job.result_file)
        return path if os.path.isfile(path) else None

    # -- the workers' side ---------------------------------------------------------------------------------------

    def claim(self, worker: str, *, kinds: Collection[str] | None = None) -> Job | None:
        """Take the oldest queued job (of one of ``kinds``, when given) for ``worker``, under a fresh lease.

        First every job whose lease ran out is requeued or failed (``reap``), so a job abandoned by a dead worker
        is taken again here, its ``attempts`` one higher. On PostgreSQL the pick is ``SELECT ... FOR UPDATE SKIP
        LOCKED``: concurrent claims take different jobs without waiting on each other; on SQLite the transaction
        holds the database's write lock.

        ``worker`` must name this claim alone (a replica's id and a counter, say): the calls that follow match the
        job by its worker's name, so a name reused for another claim of the same job (after its lease ran out)
        would let the old attempt act for the new one.

        Returns:
            The job, now ``in_progress`` and held by ``worker``; None when nothing is queued.
        """
        now = self.clock()
        with self._tx() as tx:
            self._reap(tx, now)
            query = JOBS.select().where(JOBS.c.status == QUEUED)
            if kinds is not None:
                query = query.where(JOBS.c.kind.in_(list(kinds)))
            row = tx.execute(query.order_by(JOBS.c.id).limit(1).with_for_update(skip_locked=True)).first()
            if row is None:
                return None
            values = dict(status=IN_PROGRESS, worker=worker, attempts=row.attempts + 1,
                          lease_until=now + self.lease_s)
            tx.execute(JOBS.update().where(JOBS.c.id == row.id).values(**values))
        return Job.from_row({**row._mapping, **values})

    def heartbeat(self, job_id: str, worker: str) -> bool:
        """Renew ``worker``'s lease of ``job_id`` (``lease_s`` from now).

        Returns:
            False when the job is no longer ``worker``'s to run (deleted, expired, finished, or requeued and
            perhaps claimed by another worker after the lease ran out): the worker stops and drops its work.
        """
        now = self.clock()
        return self._update_held(job_id, worker, lease_until=now + self.lease_s)

    def progress(self, job_id: str, worker: str, value: int) -> bool:
        """Record ``value`` (0-100) as the job's progress, unless it had more (progress never decreases); renews
        the lease as ``heartbeat`` does, and returns what it would."""
        if not 0 <= int(value) <= 100:
            raise ValueError(f"progress must be within 0-100, not {value}")
        value = int(value)
        now = self.clock()
        return self._update_held(job_id, worker, lease_until=now + self.lease_s,
                                 progress=sa.case((JOBS.c.progress < value, value), else_=JOBS.c.progress))

    def complete(self, job_id: str, worker: str, result_file: str) -> bool:
        """Finish ``worker``'s job with ``result_file`` as its result: the file is moved under ``results_dir``.

        The job becomes ``completed`` (progress 100), ``completed_at`` now, ``expires_at`` ``result_ttl_s`` later.
        The file is consumed either way: when the job is no longer ``worker``'s (see ``heartbeat``) it is deleted.

        Returns:
            Whether the job was ``worker``'s and is now completed.
        """
        suffix = os.path.splitext(result_file)[1]
        # a name of its own per call: a worker that lost the job never clobbers the result of the one that has it
        name = os.path.join(_checked_id(job_id), f"{secrets.token_hex(8)}{suffix}")
        path = os.path.join(self.results_dir, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        shutil.move(result_file, path)
        now = self.clock()
        try:
            done = self._update_held(job_id, worker, status=COMPLETED, progress=100, completed_at=now,
                                     expires_at=now + self.result_ttl_s, lease_until=None, result_file=name)
        except BaseException:
            _unlink(path)
            raise
        if not done:
            _unlink(path)
            _rmdir(os.path.dirname(path))
        return done

    def fail(self, job_id: str, worker: str, error: dict[str, Any], *, retry: bool = False) -> bool:
        """End ``worker``'s job with ``error``, an OpenAI error object (``code``, ``message``).

        Args:
            retry: the failure may pass (e.g. a stage replica died): queue the job again for another attempt
                while it has attempts left (``max_attempts``); ``error`` is recorded only once they are spent.

        Returns:
            Whether the job was ``worker``'s (see ``heartbeat``).
        """
        if not isinstance(error, dict) or not isinstance(error.get("code"), str) \
                or not isinstance(error.get("message"), str):
            raise ValueError("error must be an OpenAI error object: {'code': str, 'message': str}")
        now = self.clock()
        with self._tx() as tx:
            row = tx.execute(JOBS.select().where(JOBS.c.id == job_id, JOBS.c.worker == worker,
                                                 JOBS.c.status == IN_PROGRESS).with_for_update()).first()
            if row is None:
                return False
            if retry and row.attempts < self.max_attempts:
                tx.execute(JOBS.update().where(JOBS.c.id == job_id).values(status=QUEUED, progress=0, worker=None,
                                                                            lease_until=None))
            else:
                tx.execute(JOBS.update().where(JOBS.c.id == job_id).values(**self._failed(now, error)))
        return True

    # -- housekeeping (a periodic task of the API process) ---------------------------------------------------

    def reap(self, now: float | None = None) -> int:
        """Requeue every job whose lease ran out, or fail it (``job_lost``) when it was claimed ``max_attempts``
        times. ``claim`` does this too; call it periodically so jobs are failed even when no worker claims.

        Returns:
            How many jobs it requeued or failed.
        """
        with self._tx() as tx:
            return self._reap(tx, self.clock() if now is None else now)

    def expire(self, now: float | None = None) -> int:
        """Delete every finished job past its ``expires_at``, record and files.

        Returns:
            How many jobs it deleted.
        """
        now = self.clock() if now is None else now
        deleted = 0
        while True:  # in batches: one transaction stays short, its statement's parameters few
            with self._tx() as tx:
                ids = tx.scalars(sa.select(JOBS.c.id).where(JOBS.c.expires_at <= now).limit(EXPIRE_BATCH)
                                 .with_for_update(skip_locked=True)).all()
                if ids:
                    tx.execute(JOBS.delete().where(JOBS.c.id.in_(ids)))
            for job_id in ids:
                self._remove_files(job_id)
            deleted += len(ids)
            if len(ids) < EXPIRE_BATCH:
                return deleted

    def sweep_orphans(self, now: float | None = None, grace_s: float = ORPHAN_GRACE_S) -> int:
        """Remove the folders under ``results_dir`` that belong to no job: named as a job id (``ID_FORM``; any other
        entry is left alone), with no record (of any owner), and unchanged for ``grace_s`` (their modification time
        at least ``grace_s`` before ``now``). A crash between a record's delete and its folder's removal leaves such
        a folder. The grace is for jobs being created: a job's files may be written into its folder before its
        record is inserted, so a folder without a record may be a create in progress, here or in another process;
        a create must insert its record within ``grace_s`` of writing the folder.

        Scans the whole directory: call it rarely (every few minutes), not every poll.

        Args:
            now: unix time (default the store's clock), compared with the folders' modification times.
            grace_s: the age below which a folder without a record is kept (default ``ORPHAN_GRACE_S``, an hour).

        Returns:
            How many folders it removed.
        """
        if grace_s < 0:
            raise ValueError(f"grace_s must be >= 0, not {grace_s}")
        before = (self.clock() if now is None else now) - grace_s
        old = []
        try:
            with os.scandir(self.results_dir) as entries:
                for entry in entries:
                    try:
                        if ID_FORM.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False) \
                                and entry.stat(follow_symlinks=False).st_mtime <= before:
                            old.append(entry.name)
                    except FileNotFoundError:  # removed meanwhile (a delete, an expiry)
                        pass
        except FileNotFoundError:
            return 0
        removed = 0
        for start in range(0, len(old), EXPIRE_BATCH):
            batch = old[start:start + EXPIRE_BATCH]
            # read after the folders' ages: a folder that old whose create went through has its record by now
            with self._tx(read_only=True) as tx:
                known = set(tx.scalars(sa.select(JOBS.c.id).where(JOBS.c.id.in_(batch))))
            for job_id in batch:
                if job_id not in known:
                    self._remove_files(job_id)
                    removed += 1
        return removed

    # -- internals -------------------------------------------------------------------------------------------------

    def _update_held(self, job_id: str, worker: str, **values: Any) -> bool:
        """Update the job if ``worker`` holds it (``in_progress``, its worker); whether it did."""
        with self._tx() as tx:
            result = tx.execute(JOBS.update().where(JOBS.c.id == job_id, JOBS.c.worker == worker,
                                                    JOBS.c.status == IN_PROGRESS).values(**values))
        return result.rowcount == 1

    def _failed(self, now: float, error: dict[str, Any]) -> dict[str, Any]:
        return dict(status=FAILED, error=error, completed_at=now, expires_at=now + self.result_ttl_s,
                    lease_until=None)

    def _reap(self, tx: sa.Connection, now: float) -> int:
        rows = tx.execute(sa.select(JOBS.c.id, JOBS.c.attempts).where(
            JOBS.c.status == IN_PROGRESS, JOBS.c.lease_until < now).with_for_update(skip_locked=True)).all()
        for job_id, attempts in rows:
            if attempts < self.max_attempts:
                values = dict(status=QUEUED, progress=0, worker=None, lease_until=None)
            else:
                values = self._failed(now, {"code": LOST, "message": (
                    f"the job's worker stopped answering (no heartbeat for {self.lease_s:g} s) on each of its "
                    f"{attempts} attempt(s); it is not retried again")})
            tx.execute(JOBS.update().where(JOBS.c.id == job_id).values(**values))
        return len(rows)

    def _remove_files(self, job_id: str) -> None:
        shutil.rmtree(os.path.join(self.results_dir, _checked_id(job_id)), ignore_errors=True)


def _int4(value: int) -> sa.ColumnElement[int]:
    return sa.cast(sa.literal(value), sa.Integer)


def _checked_id(job_id: str) -> str:
    """``job_id`` when it has the form of a job id (it names a directory under ``results_dir``)."""
    if not ID_FORM.fullmatch(job_id):
        raise ValueError(f"not a job id: {job_id!r}")
    return job_id


def _checked_name(name: str) -> str:
    """``name`` when it can name an input file (no path, no leading dot)."""
    if not NAME_FORM.fullmatch(name):
        raise ValueError(f"not an input file name: {name!r}")
    return name


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _rmdir(path: str) -> None:
    try:
        os.rmdir(path)
    except OSError:  # not empty (another attempt's file) or gone
        pass
