"""The Videos API's job queue as ingress replicas work it (``omni_serve.kits.diffusion.video_jobs``), on a real
SQLite job store that two replicas share, with a stand-in for the graph (no Ray): a job created on one replica runs,
reports rising progress and completes with its file; a failed run is retried then failed with its error, a bad
request failed at once; a deleted job's run is cancelled, on its own replica or on the other; a replica that stops
hands its running job back, and the other finishes it; result folders left without a job are swept when a replica
starts, then rarely."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from omni_serve.api.errors import bad_request
from omni_serve.jobs import COMPLETED, FAILED, IN_PROGRESS, QUEUED, JobStore
from omni_serve.jobs.store import ORPHAN_GRACE_S, new_id
from omni_serve.kits.diffusion.video_jobs import VideoJobs


class Graph:
    """Stands in for the stages: each run waits for its gate, reporting progress as it goes."""

    def __init__(self, steps: int = 4, fail: BaseException | None = None):
        self.steps, self.fail = steps, fail
        self.gate = asyncio.Event()
        self.started, self.cancelled, self.progress = [], [], []

    async def __call__(self, job, progress) -> bytes:
        self.started.append(job.id)
        try:
            for step in range(self.steps):
                await self.gate.wait()
                self.progress.append(step)
                await progress(100 * (step + 1) // (self.steps + 1))
            if self.fail is not None:
                raise self.fail
            return b"mp4 of " + job.request["prompt"].encode()
        except asyncio.CancelledError:
            self.cancelled.append(job.id)
            raise


def _store(tmp_path, lease_s: float = 30.0) -> JobStore:
    return JobStore(f"sqlite:///{tmp_path}/jobs.sqlite3", str(tmp_path / "results"), result_ttl_s=3600,
                    lease_s=lease_s, max_attempts=2)


async def _until(predicate, timeout_s: float = 20.0) -> None:
    for _ in range(int(timeout_s / 0.02)):
        if await predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not met in time")


def test_a_job_runs_reports_rising_progress_and_completes_with_its_file(tmp_path):
    async def main():
        graph = Graph()
        jobs = VideoJobs(_store(tmp_path), graph, poll_s=0.05)
        await jobs.start()
        try:
            job = await jobs.create("alice", {"prompt": "a cat"}, max_queued=4)
            assert job.status == QUEUED and job.progress == 0
            seen = []
            graph.gate.set()

            async def done():
                now = await jobs.get(job.id, "alice")
                seen.append(now.progress)
                return now.status == COMPLETED
            await _until(done)
            final = await jobs.get(job.id, "alice")
            with open(jobs.result_path(final), "rb") as f:
                assert f.read() == b"mp4 of a cat"
            assert final.progress == 100 and seen == sorted(seen)
            assert await jobs.get(job.id, "bob") is None  # another owner's job looks unknown
        finally:
            await jobs.close()
    asyncio.run(main())


def test_a_failed_run_is_retried_then_failed_and_a_bad_request_fails_at_once(tmp_path):
    async def main():
        graph = Graph(steps=1, fail=RuntimeError("the dit replica died"))
        jobs = VideoJobs(_store(tmp_path), graph, poll_s=0.05)
        await jobs.start()
        try:
            graph.gate.set()
            job = await jobs.create("alice", {"prompt": "a cat"}, max_queued=None)

            async def failed():
                return (await jobs.get(job.id, "alice")).status == FAILED
            await _until(failed)
            final = await jobs.get(job.id, "alice")
            assert final.attempts == 2 and graph.started == [job.id, job.id]
            assert final.error["code"] == "generation_failed" and "dit replica died" in final.error["message"]
            graph.fail = bad_request("num_frames must be 4k + 1", param="num_frames")
            bad = await jobs.create("alice", {"prompt": "x"}, max_queued=None)
            await _until(lambda: _status(jobs, bad.id, FAILED))
            assert (await jobs.get(bad.id, "alice")).attempts == 1
        finally:
            await jobs.close()
    asyncio.run(main())


async def _status(jobs, job_id, status) -> bool:
    return (await jobs.get(job_id, "alice")).status == status


def test_deleting_a_running_job_cancels_its_run_on_either_replica(tmp_path):
    async def main():
        here, there = Graph(steps=50), Graph(steps=50)
        a = VideoJobs(_store(tmp_path, lease_s=0.6), here, replica="a", poll_s=0.05)
        b = VideoJobs(_store(tmp_path, lease_s=0.6), there, replica="b", poll_s=0.05)
        await a.start()
        try:
            first = await a.create("alice", {"prompt": "one"}, max_queued=None)
            await _until(lambda: _status(a, first.id, IN_PROGRESS))
            await b.start()  # the second job can only go to b: a runs one at a time
            second = await a.create("alice", {"prompt": "two"}, max_queued=None)
            await _until(lambda: _status(a, second.id, IN_PROGRESS))
            assert here.started == [first.id] and there.started == [second.id]
            assert (await a.delete(first.id, "alice")).status == IN_PROGRESS
            await _until(lambda: _true(here.cancelled == [first.id]))  # at once, on its own replica
            await a.delete(second.id, "alice")  # b's run stops at its next heartbeat
            await _until(lambda: _true(there.cancelled == [second.id]))
            assert await a.get(first.id, "alice") is None and not a.running and not b.running
        finally:
            await a.close()
            await b.close()
    asyncio.run(main())


async def _true(value: bool) -> bool:
    return value


def test_a_stopping_replica_hands_its_job_back_and_the_other_finishes_it(tmp_path):
    async def main():
        stopping, other = Graph(), Graph()
        a = VideoJobs(_store(tmp_path), stopping, replica="a", poll_s=0.05)
        await a.start()
        job = await a.create("alice", {"prompt": "a cat"}, max_queued=None)
        await _until(lambda: _true(stopping.started == [job.id]))
        await a.close()
        assert stopping.cancelled == [job.id]
        b = VideoJobs(_store(tmp_path), other, replica="b", poll_s=0.05)
        await b.start()
        try:
            other.gate.set()
            await _until(lambda: _status(b, job.id, COMPLETED))
            assert (await b.get(job.id, "alice")).attempts == 2
        finally:
            await b.close()
    asyncio.run(main())


def test_max_running_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="max_running"):
        VideoJobs(_store(tmp_path), Graph(), max_running=0)


def test_a_graph_answer_of_5xx_is_retried_like_a_lost_stage(tmp_path):
    from omni_serve.api.errors import service_unavailable

    async def main():
        graph = Graph(steps=1, fail=service_unavailable("Stage dit has no running replica"))
        jobs = VideoJobs(_store(tmp_path), graph, poll_s=0.05)
        await jobs.start()
        try:
            graph.gate.set()
            job = await jobs.create("alice", {"prompt": "a cat"}, max_queued=None)
            await _until(lambda: _status(jobs, job.id, FAILED))
            final = await jobs.get(job.id, "alice")
            assert final.attempts == 2 and "no running replica" in final.error["message"]
        finally:
            await jobs.close()
    asyncio.run(main())


def test_the_worker_loop_sweeps_orphaned_folders_when_it_starts_then_rarely(tmp_path):
    async def main():
        store = _store(tmp_path)
        orphan = tmp_path / "results" / new_id(time.time())
        orphan.mkdir(parents=True)
        old = time.time() - 2 * ORPHAN_GRACE_S
        os.utime(orphan, (old, old))
        sweeps, rounds = [], []
        sweep, expire = store.sweep_orphans, store.expire
        store.sweep_orphans = lambda: sweeps.append(sweep())
        store.expire = lambda: rounds.append(expire())
        jobs = VideoJobs(store, Graph(), poll_s=0.01)
        await jobs.start()
        try:
            await _until(lambda: _true(len(rounds) >= 10))
            assert sweeps == [1] and not orphan.exists()  # one sweep in ten polls: the first
        finally:
            await jobs.close()
    asyncio.run(main())
