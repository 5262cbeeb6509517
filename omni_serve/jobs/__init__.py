"""Asynchronous jobs (OpenAI's Videos API) that outlive any one ingress replica: records in a database, results as
files.

Contract: ``JobStore`` (``store.py``) keeps job records in a database through SQLAlchemy: a SQLite file on one node
(the default), PostgreSQL shared by several ingress replicas, so any replica answers for any job. Its schema is
versioned by Alembic migrations inside this package (``migrations/``), applied by ``JobStore.open()``. Results are
files under a configured directory (shared by the replicas); a finished job and its files are deleted
``result_ttl_s`` after it finished. Workers claim jobs under a lease: a job whose worker dies is retried, or failed
with a clear error (``job_lost``) after ``max_attempts``, never left ``in_progress``. ``create`` refuses
(``QueueFull``) past an owner's limit of queued jobs. The store is synchronous: call it through
``asyncio.to_thread`` from an event loop. ``JobStoreSpec`` (``spec.py``) is its settings. No HTTP routes and no
model code here: this layer imports nothing of omni_serve's above ``settings``.
"""

from omni_serve.jobs.models import COMPLETED, FAILED, IN_PROGRESS, OBJECT, QUEUED, Job
from omni_serve.jobs.spec import JobStoreSpec
from omni_serve.jobs.store import LOST, JobStore, QueueFull

__all__ = ["COMPLETED", "FAILED", "IN_PROGRESS", "LOST", "OBJECT", "QUEUED", "Job", "JobStore", "JobStoreSpec",
           "QueueFull"]
