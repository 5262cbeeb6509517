"""Video jobs: the Videos API's queue, worked by every ingress replica of a video graph.

Contract: ``VideoJobs(store, run, *, replica, max_running, poll_s)`` over a ``JobStore`` (``omni_serve.jobs``) that
every replica shares (a SQLite file on one node, PostgreSQL across nodes). ``start()`` opens the store and starts
the replica's worker loop; ``close()`` stops it (idempotent): jobs running here are handed back to the queue
(``fail(retry=True)``, code ``replica_stopped``) for another replica. The routes' side: ``create`` (with input
files, which the run reads back with ``read_input``), ``get``, ``list``, ``delete`` (a job running here is
cancelled at once; one running on another replica stops at that replica's next heartbeat or progress call, which the
deleted record refuses) and ``result_path``. Every store call runs in a thread (the store is synchronous).

The worker loop claims jobs (oldest first) while fewer than ``max_running`` run here, every ``poll_s`` or at once
when this replica created one; it also fails or requeues jobs whose replica died (their lease ran out: ``reap``),
deletes expired results (``expire``) and, at most every ``SWEEP_EVERY_S`` (the first time when it starts), removes
the result folders left without a job (``sweep_orphans``, with its default grace). A job runs as
``await run(job, progress)``, which returns its file's bytes (an MP4, or ``request["output_format"]``'s);
``await progress(percent)`` records its progress (and renews its lease) and returns False once the job is no
longer this replica's (deleted, or its lease lost), and the job is then cancelled. Its lease is also renewed every
``lease_s / 3`` while it runs. A run that raises a 4xx ``OpenAIError`` fails the job with that error (a bad
request, a graph limit); a 5xx one (a stage without a replica, a timeout) or any other exception hands it back to
the queue while it has attempts left, then fails it with the error.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

from omni_serve.api.errors import OpenAIError
from omni_serve.jobs import Job, JobStore

log = logging.getLogger(__name__)

KIND = "video"
SWEEP_EVERY_S = 300.0  # between two sweeps of orphaned result folders by one replica (a scan of results_dir)
RunJob = Callable[[Job, Callable[[int], Awaitable[bool]]], Awaitable[bytes]]


class VideoJobs:
    def __init__(self, store: JobStore, run: RunJob, *, replica: str | None = None, max_running: int = 1,
                 poll_s: float = 1.0):
        if max_running < 1:
            raise ValueError(f"max_running must be at least 1, not {max_running}")
        self.store, self.run, self.max_running, self.poll_s = store, run, max_running, poll_s
        self.replica = replica or secrets.token_hex(4)
        self.running: dict[str, asyncio.Task] = {}  # job id -> its task, on this replica
        self._claims = 0
        self._next_sweep = 0.0  # time.monotonic() of the next sweep_orphans
        self._wake = asyncio.Event()
        self._loop: asyncio.Task | None = None
        self._closed = False

    # -- lifecycle -----------------------------------------------------------------------------------------------
    async def start(self) -> None:
        await asyncio.to_thread(self.store.open)
        self._loop = asyncio.create_task(self._work(), name=f"video-jobs-{self.replica}")

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._loop is not None:
            self._loop.cancel()
            await asyncio.gather(self._loop, return_exceptions=True)
        for job_id, task in list(self.running.items()):
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            worker = task.get_name()
            await asyncio.to_thread(self.store.fail, job_id, worker, {
                "code": "replica_stopped", "message": "the replica running the job stopped; it is retried"},
                retry=True)
        self.running.clear()
        await asyncio.to_thread(self.store.close)

    # -- the routes' side ----------------------------------------------------------------------------------------
    async def create(self, owner: str, request: dict[str, Any], *, max_queued: int | None,
                     inputs: dict[str, bytes] | None = None) -> Job:
        job = await asyncio.to_thread(self.store.create, KIND, owner, request, max_queued=max_queued, inputs=inputs)
        self._wake.set()
        return job

    async def get(self, job_id: str, owner: str) -> Job | None:
        return await asyncio.to_thread(self.store.get, job_id, owner)

    async def list(self, owner: str, *, after: str | None, limit: int, order: str) -> tuple[list[Job], bool]:
        return await asyncio.to_thread(self.store.list, owner, after=after, limit=limit, order=order)

    async def delete(self, job_id: str, owner: str) -> Job | None:
        job = await asyncio.to_thread(self.store.delete, job_id, owner)
        task = self.running.get(job_id) if job is not None else None
        if task is not None:
            task.cancel()  # its stage calls are cancelled with it, which frees their state and payloads
        return job

    def result_path(self, job: Job) -> str | None:
        return self.store.result_path(job)

    async def read_input(self, job: Job, name: str) -> bytes:
        """The job's input file ``name`` (given to ``create``)."""
        def read() -> bytes:
            with open(self.store.input_path(job, name), "rb") as f:
                return f.read()
        return await asyncio.to_thread(read)

    # -- the worker loop -----------------------------------------------------------------------------------------
    async def _work(self) -> None:
        while True:
            try:
                await asyncio.to_thread(self.store.expire)
                while len(self.running) < self.max_running:
                    self._claims += 1
                    worker = f"{self.replica}-{self._claims}"  # unique per claim (JobStore.claim)
                    job = await asyncio.to_thread(self.store.claim, worker, kinds=(KIND,))
                    if job is None:
                        break
                    task = asyncio.create_task(self._run(job, worker), name=worker)
                    self.running[job.id] = task
                    task.add_done_callback(lambda _, job_id=job.id: self.running.pop(job_id, None))
                if time.monotonic() >= self._next_sweep:
                    self._next_sweep = time.monotonic() + SWEEP_EVERY_S  # a failed sweep waits its turn too
                    await asyncio.to_thread(self.store.sweep_orphans)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the database may be briefly unreachable: try again next round
                log.exception("video jobs: a round of the worker loop failed")
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), self.poll_s)
            except asyncio.TimeoutError:
                pass

    async def _run(self, job: Job, worker: str) -> None:
        me = asyncio.current_task()
        last = [-1]

        async def progress(percent: int) -> bool:
            percent = max(0, min(99, int(percent)))  # 100 when the file is stored
            if percent == last[0]:
                return True
            last[0] = percent
            held = await asyncio.to_thread(self.store.progress, job.id, worker, percent)
            if not held:
                me.cancel()
            return held

        beat = asyncio.create_task(self._heartbeat(job.id, worker, me))
        try:
            video = await self.run(job, progress)
        except asyncio.CancelledError:
            return  # deleted, the lease lost, or the replica stopping (close() hands the job back)
        except OpenAIError as err:  # the graph's own answer: a 4xx fails the job, a 5xx (a stage lost) may pass
            retry = err.status_code >= 500
            await asyncio.to_thread(self.store.fail, job.id, worker, {"code": err.code or err.type,
                                                                      "message": err.message}, retry=retry)
            if retry:
                self._wake.set()
            return
        except Exception as err:  # noqa: BLE001 - a stage died or timed out: another attempt may pass
            log.warning("video job %s failed on attempt %d: %r", job.id, job.attempts, err)
            await asyncio.to_thread(self.store.fail, job.id, worker, {
                "code": "generation_failed", "message": f"generating the video failed: {err}"}, retry=True)
            self._wake.set()
            return
        finally:
            beat.cancel()
        suffix = "." + job.request.get("output_format", "mp4")
        await asyncio.to_thread(self._complete, job.id, worker, video, suffix)

    def _complete(self, job_id: str, worker: str, video: bytes, suffix: str) -> None:
        fd, path = tempfile.mkstemp(suffix=suffix, prefix="omni_serve_video_",
                                    dir=self.store.results_dir if os.path.isdir(self.store.results_dir) else None)
        with os.fdopen(fd, "wb") as f:
            f.write(video)
        self.store.complete(job_id, worker, path)  # moves the file (deletes it when the job is no longer ours)

    async def _heartbeat(self, job_id: str, worker: str, task: asyncio.Task) -> None:
        while True:
            await asyncio.sleep(self.store.lease_s / 3)
            if not await asyncio.to_thread(self.store.heartbeat, job_id, worker):
                task.cancel()
                return
