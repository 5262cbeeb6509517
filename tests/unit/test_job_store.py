"""The job store (omni_serve.jobs) on both of its backends: a SQLite file and a real PostgreSQL server.

The PostgreSQL server is a throwaway cluster the session starts itself (tests/postgres.py), one per session, a
fresh database per test. Time is a fake clock the test moves. No Ray.
"""

from __future__ import annotations

import os
import threading

import pytest
import sqlalchemy as sa

from omni_serve.jobs import COMPLETED, FAILED, IN_PROGRESS, LOST, QUEUED, JobStore, JobStoreSpec, QueueFull
from omni_serve.jobs.store import ORPHAN_GRACE_S, new_id

T0 = 1_800_000_000.0


class Clock:
    def __init__(self, t: float):
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/db/jobs.sqlite3"
    return request.getfixturevalue("postgres").create_database()


@pytest.fixture
def clock():
    return Clock(T0)


@pytest.fixture
def make(url, tmp_path, clock):
    """Stores on the test's database (opened unless ``open=False``), closed at the end."""
    stores = []

    def make(*, open: bool = True, **kw) -> JobStore:
        args = dict(result_ttl_s=100.0, lease_s=10.0, max_attempts=2, clock=clock) | kw
        store = JobStore(url, str(tmp_path / "results"), **args)
        stores.append(store)
        return store.open() if open else store

    yield make
    for store in stores:
        store.close()


@pytest.fixture
def store(make):
    return make()


def _versions(url: str) -> list[str]:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as c:
            assert sa.inspect(c).has_table("jobs")
            return [v for (v,) in c.execute(sa.text("SELECT version_num FROM alembic_version"))]
    finally:
        engine.dispose()


def _in_threads(target, n: int) -> None:
    """``target(i)`` for i < n, each in a thread, started at once; fails (rather than hangs) past a minute."""
    barrier = threading.Barrier(n)

    def run(i):
        barrier.wait()
        target(i)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "threads still running after a minute (a lock never released?)"


def _result(tmp_path, name: str = "out.mp4", data: bytes = b"video") -> str:
    path = tmp_path / name
    path.write_bytes(data)
    return str(path)


def _paths(tmp_path) -> set[str]:
    root = tmp_path / "results"
    return {os.path.relpath(os.path.join(d, f), root) for d, _, files in os.walk(root) for f in files}


# -- schema -----------------------------------------------------------------------------------------------------


def test_migrations_are_applied_once_and_reopening_keeps_the_jobs(make, url):
    store = make()
    job = store.create("m", "alice", {"prompt": "a cat"}, max_queued=None)
    store.open()  # a second open of one store: nothing
    store.close()
    store.close()
    store.open()
    again = make()
    assert _versions(url) == ["0001"]
    assert store.get(job.id, "alice") == again.get(job.id, "alice") == job


def test_two_stores_opening_a_new_database_at_once_migrate_it_once(make, url):
    stores = [make(open=False) for _ in range(3)]
    errors = []

    def run(i):
        try:
            stores[i].open()
        except Exception as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)

    _in_threads(run, len(stores))
    assert not errors
    assert _versions(url) == ["0001"]
    job = stores[0].create("m", "alice", {}, max_queued=None)
    assert stores[2].get(job.id, "alice") == job


# -- the owners' side ------------------------------------------------------------------------------------------


def test_create_get_and_list_pages_in_both_orders(store, clock):
    jobs = []
    for i in range(5):
        clock.t = T0 + i
        jobs.append(store.create("m", "alice", {"prompt": f"p{i}", "seconds": "4"}, max_queued=None))
    store.create("m", "bob", {}, max_queued=None)
    first = jobs[0]
    assert first.id.startswith("video_") and len(first.id) == len("video_") + 32
    assert (first.object, first.status, first.progress, first.attempts) == ("video", QUEUED, 0, 0)
    assert first.created_at == int(T0) and first.completed_at is None and first.expires_at is None
    assert store.get(first.id, "alice") == first and first.request == {"prompt": "p0", "seconds": "4"}
    ids = [j.id for j in jobs]
    assert ids == sorted(ids)

    for order, expected in (("asc", ids), ("desc", ids[::-1])):
        seen, after, more = [], None, True
        while more:
            page, more = store.list("alice", after=after, limit=2, order=order)
            assert len(page) == (2 if more else 1)
            seen += [j.id for j in page]
            after = page[-1].id
        assert seen == expected
    page, more = store.list("alice", limit=5, order="asc")
    assert [j.id for j in page] == ids and not more
    store.delete(ids[1], "alice")  # a cursor whose job is gone still pages on
    page, _ = store.list("alice", after=ids[1], limit=10, order="asc")
    assert [j.id for j in page] == ids[2:]
    with pytest.raises(ValueError):
        store.list("alice", limit=0)


def test_another_owners_jobs_look_unknown(store, tmp_path):
    job = store.create("m", "alice", {}, max_queued=None)
    assert store.get(job.id, "bob") is None
    assert store.list("bob", limit=10) == ([], False)
    assert store.delete(job.id, "bob") is None
    assert store.get(job.id, "alice") == job


def test_queue_limit_counts_queued_and_in_progress_jobs(store, tmp_path):
    a = store.create("m", "alice", {}, max_queued=2)
    store.create("m", "alice", {}, max_queued=2)
    with pytest.raises(QueueFull) as info:
        store.create("m", "alice", {}, max_queued=2)
    assert info.value.limit == 2 and "at most 2" in str(info.value)
    store.create("m", "bob", {}, max_queued=2)  # per owner
    store.create("m", "alice", {}, max_queued=None)  # no limit
    claimed = store.claim("w")
    assert claimed.id == a.id
    with pytest.raises(QueueFull):  # in progress counts too
        store.create("m", "alice", {}, max_queued=3)
    assert store.complete(a.id, "w", _result(tmp_path))
    store.create("m", "alice", {}, max_queued=3)


def test_input_files_live_with_their_job(store, tmp_path):
    job = store.create("m", "alice", {}, max_queued=1, inputs={"input_reference.png": b"frame"})
    path = store.input_path(job, "input_reference.png")
    with open(path, "rb") as f:
        assert f.read() == b"frame"
    claimed = store.claim("w")  # a retried job reads them again: they outlive an attempt
    assert store.fail(claimed.id, "w", {"code": "x", "message": "y"}, retry=True) and os.path.exists(path)
    with pytest.raises(QueueFull):  # a refused create leaves no files behind
        store.create("m", "alice", {}, max_queued=1, inputs={"input_reference.png": b"other"})
    assert sorted(os.listdir(store.results_dir)) == [job.id]
    store.delete(job.id, "alice")
    assert not os.path.exists(os.path.dirname(os.path.dirname(path)))
    for name in ("../x", ".hidden", "a/b", ""):
        with pytest.raises(ValueError, match="input file name"):
            store.create("m", "alice", {}, max_queued=None, inputs={name: b""})
    assert os.listdir(store.results_dir) == []


def test_concurrent_creates_never_pass_the_queue_limit(make):
    stores = [make(), make()]
    made, refused = [], []

    def run(i):
        try:
            made.append(stores[i % 2].create("m", "alice", {}, max_queued=3))
        except QueueFull:
            refused.append(i)

    _in_threads(run, 8)
    assert (len(made), len(refused)) == (3, 5)


# -- the workers' side -----------------------------------------------------------------------------------------


def test_claims_take_the_oldest_queued_job_of_the_kinds_asked(store, clock):
    a = store.create("video-model", "alice", {"n": 1}, max_queued=None)
    clock.t += 1
    b = store.create("other-model", "bob", {}, max_queued=None)
    clock.t += 1
    c = store.create("video-model", "alice", {}, max_queued=None)
    got = store.claim("w1")
    assert (got.id, got.status, got.worker, got.attempts) == (a.id, IN_PROGRESS, "w1", 1)
    assert got.lease_until == clock.t + 10 and got.request == {"n": 1}
    assert store.get(a.id, "alice") == got
    assert store.claim("w2", kinds=["video-model"]).id == c.id
    assert store.claim("w2", kinds=["video-model"]) is None
    assert store.claim("w3").id == b.id
    assert store.claim("w3") is None


def test_concurrent_claims_from_two_stores_never_take_one_job_twice(make):
    stores = [make(), make()]
    ids = {stores[0].create("m", f"o{i % 3}", {}, max_queued=None).id for i in range(16)}
    taken: list[list[str]] = [[] for _ in range(4)]

    def run(i):
        while (job := stores[i % 2].claim(f"w{i}")) is not None:
            taken[i].append(job.id)

    _in_threads(run, 4)
    every = [j for part in taken for j in part]
    assert len(every) == len(set(every)) == 16 and set(every) == ids


def test_a_lost_lease_is_retried_then_failed_with_a_clear_error(store, clock):
    job = store.create("m", "alice", {}, max_queued=None)
    assert store.claim("w1").attempts == 1
    clock.t += 9
    assert store.progress(job.id, "w1", 40)  # renewed: until T0 + 19
    clock.t += 9
    assert store.claim("w2") is None
    clock.t += 2  # past the lease: requeued and claimed again
    again = store.claim("w2")
    assert (again.id, again.attempts, again.worker, again.progress) == (job.id, 2, "w2", 0)  # progress starts over
    assert not store.heartbeat(job.id, "w1") and not store.progress(job.id, "w1", 50)
    clock.t += 11  # the second attempt's lease runs out too: max_attempts (2) spent
    assert store.claim("w3") is None
    failed = store.get(job.id, "alice")
    assert failed.status == FAILED and failed.error["code"] == LOST
    assert "2 attempt" in failed.error["message"] and "not retried" in failed.error["message"]
    assert failed.completed_at == int(clock.t) and failed.expires_at == int(clock.t + 100)
    assert not store.heartbeat(job.id, "w2")


def test_reap_fails_lost_jobs_without_any_claim(make, clock):
    store = make(max_attempts=1)
    job = store.create("m", "alice", {}, max_queued=None)
    store.claim("w1")
    assert store.reap() == 0
    clock.t += 11
    assert store.reap() == 1
    assert store.get(job.id, "alice").status == FAILED
    assert store.reap() == 0


def test_fail_records_the_error_or_requeues_while_attempts_remain(store):
    job = store.create("m", "alice", {}, max_queued=None)
    store.claim("w1")
    with pytest.raises(ValueError):
        store.fail(job.id, "w1", {"message": "no code"})
    assert not store.fail(job.id, "w2", {"code": "x", "message": "not w2's"})
    died = {"code": "stage_died", "message": "a stage replica died"}
    assert store.fail(job.id, "w1", died, retry=True)
    assert store.get(job.id, "alice").status == QUEUED
    assert store.claim("w2").attempts == 2
    assert store.fail(job.id, "w2", died, retry=True)  # attempts spent: failed
    failed = store.get(job.id, "alice")
    assert (failed.status, failed.error) == (FAILED, died)
    assert not store.fail(job.id, "w2", died)


def test_progress_never_decreases_and_renews_the_lease(store, clock):
    job = store.create("m", "alice", {}, max_queued=None)
    store.claim("w")
    clock.t += 5
    assert store.progress(job.id, "w", 40)
    assert store.progress(job.id, "w", 30)
    got = store.get(job.id, "alice")
    assert got.progress == 40 and got.lease_until == clock.t + 10
    with pytest.raises(ValueError):
        store.progress(job.id, "w", 101)
    assert not store.progress(job.id, "other", 90)
    assert store.get(job.id, "alice").progress == 40


def test_a_deleted_jobs_worker_is_told_to_stop_and_its_result_discarded(store, tmp_path):
    job = store.create("m", "alice", {}, max_queued=None)
    store.claim("w")
    deleted = store.delete(job.id, "alice")
    assert deleted.status == IN_PROGRESS and deleted.worker == "w"
    assert store.get(job.id, "alice") is None
    assert not store.heartbeat(job.id, "w")
    result = _result(tmp_path)
    assert not store.complete(job.id, "w", result)
    assert not os.path.exists(result) and _paths(tmp_path) == set()


def test_complete_keeps_the_result_until_it_expires(store, clock, tmp_path):
    job = store.create("m", "alice", {}, max_queued=None)
    other = store.create("m", "alice", {}, max_queued=None)
    store.claim("w")
    clock.t += 3
    assert store.complete(job.id, "w", _result(tmp_path, "clip.mp4", b"mp4 bytes"))
    done = store.get(job.id, "alice")
    assert (done.status, done.progress, done.completed_at, done.expires_at) == (
        COMPLETED, 100, int(T0 + 3), int(T0 + 103))
    path = store.result_path(done)
    assert path.endswith(".mp4") and open(path, "rb").read() == b"mp4 bytes"
    assert path.startswith(str(tmp_path / "results" / job.id) + os.sep)
    assert store.result_path(store.get(other.id, "alice")) is None
    assert not store.complete(job.id, "w", _result(tmp_path))  # finished: no longer the worker's
    assert _paths(tmp_path) == {os.path.relpath(path, tmp_path / "results")}
    clock.t += 99
    assert store.expire() == 0
    clock.t += 1
    assert store.expire() == 1
    assert store.get(job.id, "alice") is None and not os.path.exists(path) and _paths(tmp_path) == set()
    assert store.get(other.id, "alice") is not None  # queued jobs never expire


def test_delete_removes_the_record_and_its_files(store, tmp_path):
    job = store.create("m", "alice", {}, max_queued=None)
    store.claim("w")
    store.complete(job.id, "w", _result(tmp_path))
    path = store.result_path(store.get(job.id, "alice"))
    assert os.path.isfile(path)
    deleted = store.delete(job.id, "alice")
    assert deleted.status == COMPLETED and deleted.id == job.id
    assert not os.path.exists(os.path.dirname(path)) and store.get(job.id, "alice") is None
    assert store.delete(job.id, "alice") is None
    assert store.result_path(deleted) is None


def _folder(root, name: str, mtime: float) -> str:
    """A folder ``root/name`` holding a file, last changed at ``mtime``."""
    path = os.path.join(root, name)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "input.png"), "wb") as f:
        f.write(b"input")
    os.utime(path, (mtime, mtime))
    return path


def test_sweep_removes_only_old_job_folders_without_a_record(store, clock, tmp_path):
    root = str(tmp_path / "results")
    old, recent = T0 - ORPHAN_GRACE_S - 1, T0 - 10
    finished = store.create("m", "alice", {}, max_queued=None)
    store.claim("w")
    store.complete(finished.id, "w", _result(tmp_path))
    queued = store.create("m", "bob", {}, max_queued=None)  # another owner's: a record is a record
    creating, a_file = new_id(T0), new_id(T0)
    kept = {finished.id: old, queued.id: old,
            creating: recent,  # a job being created: its files first, its record next
            "video_not_an_id": old, "notes": old}
    orphans = {new_id(T0 - 7200): old, new_id(T0 - 5): T0 - ORPHAN_GRACE_S}
    for name, mtime in (kept | orphans).items():
        _folder(root, name, mtime)
    with open(os.path.join(root, a_file), "wb") as f:  # a file named as a job, not a folder: left alone
        f.write(b"x")
    os.utime(os.path.join(root, a_file), (old, old))
    assert store.sweep_orphans() == 2
    assert set(os.listdir(root)) == {*kept, a_file}
    assert open(store.result_path(store.get(finished.id, "alice")), "rb").read() == b"video"
    assert store.sweep_orphans() == 0
    clock.t += 9  # the create in progress never inserted its record: its folder goes once the grace has passed
    assert store.sweep_orphans(grace_s=20) == 0
    clock.t += 1
    assert store.sweep_orphans(grace_s=20) == 1
    assert set(os.listdir(root)) == {*kept, a_file} - {creating}
    with pytest.raises(ValueError, match="grace_s"):
        store.sweep_orphans(grace_s=-1)


def test_sweep_of_a_missing_results_dir_removes_nothing(make, tmp_path):
    store = make()
    os.rmdir(tmp_path / "results")
    assert store.sweep_orphans() == 0


# -- settings --------------------------------------------------------------------------------------------------


def test_the_database_url_may_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("OMNI_SERVE_JOBS_URL", "postgresql://u:secret@h/db")
    assert JobStoreSpec().resolved_url() == "postgresql://u:secret@h/db"
    assert JobStoreSpec(url="postgresql://other@h/db").resolved_url() == "postgresql://other@h/db"  # url first


def test_the_spec_defaults_to_a_sqlite_file_and_results_under_its_dir(tmp_path, monkeypatch):
    monkeypatch.delenv("OMNI_SERVE_JOBS_URL", raising=False)
    spec = JobStoreSpec(dir=str(tmp_path / "jobs"))
    assert spec.resolved_url() == f"sqlite:///{tmp_path}/jobs/jobs.sqlite3"
    assert spec.resolved_results_dir() == str(tmp_path / "jobs" / "results")
    with spec.store() as store:
        job = store.create("m", "alice", {}, max_queued=spec.max_queued_per_key)
        assert store.get(job.id, "alice") == job
    assert os.path.isfile(tmp_path / "jobs" / "jobs.sqlite3")
    store = JobStoreSpec(url="postgresql://u@h/db").store()
    assert store.url.drivername == "postgresql+psycopg"
    for bad in ("sqlite://", "sqlite:///:memory:", "mysql://u@h/db"):
        with pytest.raises(ValueError):
            JobStoreSpec(url=bad).store()
    with pytest.raises(ValueError):
        JobStoreSpec(lease_s=0)
    with pytest.raises(ValueError):
        JobStoreSpec(unknown=1)
    assert all(f.description for f in JobStoreSpec.model_fields.values())
