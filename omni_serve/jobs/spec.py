"""``JobStoreSpec``: the settings of the job store (where records and results live, how long, how many).

Contract: every field has a default, so an empty section is a working single-node store: a SQLite file and a
results directory under ``dir``. Several ingress replicas need ``url`` to name one PostgreSQL database and
``results_dir`` one directory every replica (and every worker) sees. ``store()`` builds the (unopened)
``JobStore`` these settings describe. A URL that holds a password belongs in the environment, not in a config
file: with ``url`` unset, ``OMNI_SERVE_JOBS_URL`` (the Helm chart sets it from a Secret) names the database.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from pydantic import BaseModel, ConfigDict, Field

DEFAULT_DIR = os.path.join("~", ".local", "state", "omni_serve", "jobs")
URL_ENV = "OMNI_SERVE_JOBS_URL"  # the database's URL when ``url`` is unset (a Secret's, in Kubernetes)


class JobStoreSpec(BaseModel):
    """The job store's settings (jobs of the Videos API: ``POST /v1/videos`` and the routes beside it)."""

    model_config = ConfigDict(extra="forbid")

    dir: str = Field(DEFAULT_DIR, description=(
        "Directory of the default SQLite database (jobs.sqlite3) and of the default results directory "
        "(results/); '~' is the user's home. Created when missing."))
    url: str | None = Field(None, description=(
        "SQLAlchemy URL of the job database: default the environment's OMNI_SERVE_JOBS_URL, else a SQLite file "
        "under dir (one node only). Several ingress replicas share a PostgreSQL database: "
        "'postgresql://user:password@host:5432/db' (the psycopg 3 driver is used whatever driver the URL "
        "names)."))
    results_dir: str | None = Field(None, description=(
        "Directory of the jobs' result files (default: dir/results). With several ingress replicas, a directory "
        "they all see (a shared volume), as they all answer for every job."))
    result_ttl_s: float = Field(3600.0, gt=0, description=(
        "Seconds a finished job (completed or failed) and its result are kept; past them both are deleted and "
        "the job's id answers as unknown."))
    lease_s: float = Field(60.0, gt=0, description=(
        "Seconds a worker holds a job it claimed without renewing the lease (a heartbeat or a progress report "
        "renews it). A job whose lease runs out is retried by another worker, or failed after max_attempts."))
    max_attempts: int = Field(2, ge=1, description=(
        "Claims a job may take: once its lease has run out this many times it fails (error code 'job_lost') "
        "instead of being retried."))
    max_queued_per_key: int | None = Field(8, ge=1, description=(
        "Jobs an API key may have queued or in progress at once; one more is refused (HTTP 429). None: no "
        "limit."))

    def resolved_dir(self) -> str:
        """``dir``, with ``~`` expanded, absolute."""
        return os.path.abspath(os.path.expanduser(self.dir))

    def resolved_url(self) -> str:
        """``url``, else ``OMNI_SERVE_JOBS_URL``, else the URL of the default SQLite file under ``dir``."""
        return self.url or os.environ.get(URL_ENV) or "sqlite:///" + os.path.join(self.resolved_dir(), "jobs.sqlite3")

    def resolved_results_dir(self) -> str:
        """``results_dir`` (``~`` expanded, absolute), or ``dir``'s ``results/``."""
        if self.results_dir:
            return os.path.abspath(os.path.expanduser(self.results_dir))
        return os.path.join(self.resolved_dir(), "results")

    def store(self, *, clock: Callable[[], float] | None = None):
        """The ``JobStore`` of these settings, not yet opened (``open()`` it, in a thread from an event loop)."""
        from omni_serve.jobs.store import JobStore

        return JobStore(self.resolved_url(), self.resolved_results_dir(), result_ttl_s=self.result_ttl_s,
                        lease_s=self.lease_s, max_attempts=self.max_attempts, clock=clock)
