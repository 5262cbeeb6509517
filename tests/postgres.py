"""A throwaway PostgreSQL server for tests: ``initdb`` + ``pg_ctl start`` in a temporary directory, one per session.

Contract: the session fixture ``postgres`` yields a ``PostgresServer`` (``url(database)``, ``create_database()``)
listening on a free localhost port, its unix socket in its own temporary directory; at the end it is stopped
(``pg_ctl stop -m immediate``) and the directory removed; a session killed before that leaves its pid in the
directory, and the next session stops the server it left. The binaries come from ``pg_config --bindir``, else the
newest ``/usr/lib/postgresql/*/bin``, else ``PATH`` (Debian's ``postgresql`` package, installed by
``scripts/install_system_deps.sh``). As root, the server runs as the ``postgres`` system user (``runuser``), which
owns the directory. Without any PostgreSQL binaries the tests that use it are skipped with the reason, unless
``OMNI_SERVE_REQUIRE_POSTGRES`` is set: then, as when the server does not start, they fail.
"""

from __future__ import annotations

import glob
import itertools
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from dataclasses import dataclass, field

import pytest

REQUIRE_ENV = "OMNI_SERVE_REQUIRE_POSTGRES"
USER = "postgres"  # the system user (as root) and the database superuser
PREFIX = "omni_serve_pg_"  # of the session's directory (in the temporary directory), which holds session.pid


def _version(path: str) -> int:
    """The major version of ``/usr/lib/postgresql/<major>/bin`` (0 when it is not a number)."""
    major = os.path.basename(os.path.dirname(path))
    return int(major) if major.isdigit() else 0


def bindir() -> str | None:
    """The directory of ``initdb`` and ``pg_ctl``, or None."""
    found = []
    if shutil.which("pg_config"):
        out = subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True, timeout=30)
        found.append(out.stdout.strip())
    found += sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=_version, reverse=True)
    if shutil.which("initdb"):
        found.append(os.path.dirname(os.path.realpath(shutil.which("initdb"))))
    for d in found:
        if d and all(os.access(os.path.join(d, tool), os.X_OK) for tool in ("initdb", "pg_ctl")):
            return d
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class PostgresServer:
    """A running server: superuser ``postgres``, no password (trust), on ``127.0.0.1:port``."""

    bin: str
    root: str
    port: int
    as_user: list[str]
    _names: itertools.count = field(default_factory=itertools.count)

    @property
    def data(self) -> str:
        return os.path.join(self.root, "data")

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg://{USER}@127.0.0.1:{self.port}/{database}"

    def create_database(self) -> str:
        """A new empty database; its URL."""
        import psycopg

        name = f"test_{os.getpid()}_{next(self._names)}"
        with psycopg.connect(host="127.0.0.1", port=self.port, user=USER, dbname="postgres", autocommit=True) as c:
            c.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def tool(self, name: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run([*self.as_user, os.path.join(self.bin, name), *args], capture_output=True, text=True,
                              check=check, timeout=120)

    def log_tail(self) -> str:
        try:
            with open(os.path.join(self.root, "server.log")) as f:
                return f.read()[-3000:]
        except OSError:
            return ""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stop_abandoned(bin_dir: str, as_user: list[str]) -> None:
    """Stop the servers of earlier sessions that were killed before their teardown (their pid file names a dead
    process), and remove their directories."""
    for root in glob.glob(os.path.join(tempfile.gettempdir(), PREFIX + "*")):
        try:
            with open(os.path.join(root, "session.pid")) as f:
                pid = int(f.read())
        except (OSError, ValueError):
            continue
        if not _alive(pid):
            _stop(PostgresServer(bin_dir, root, 0, as_user))


def _start(bin_dir: str) -> PostgresServer:
    root = tempfile.mkdtemp(prefix=PREFIX)
    with open(os.path.join(root, "session.pid"), "w") as f:
        f.write(str(os.getpid()))
    as_user: list[str] = []
    if os.geteuid() == 0:  # initdb refuses root: run as the postgres system user, owner of the directory
        try:
            user = pwd.getpwnam(USER)
        except KeyError:
            shutil.rmtree(root, ignore_errors=True)
            pytest.fail(f"running as root and there is no {USER!r} system user to run PostgreSQL as (Debian's "
                        "postgresql package creates it)")
        os.chown(root, user.pw_uid, user.pw_gid)
        as_user = ["runuser", "-u", USER, "--"]
    _stop_abandoned(bin_dir, as_user)
    server = PostgresServer(bin_dir, root, _free_port(), as_user)
    sock = os.path.join(root, "sock")
    try:
        server.tool("initdb", "-D", server.data, "-U", USER, "-A", "trust", "-E", "UTF8", "--locale=C", "--no-sync")
        subprocess.run([*as_user, "mkdir", sock], check=True, capture_output=True, text=True)
        options = (f"-p {server.port} -k {sock} -c listen_addresses=127.0.0.1 -c fsync=off "
                   "-c synchronous_commit=off -c full_page_writes=off")
        server.tool("pg_ctl", "-D", server.data, "-l", os.path.join(root, "server.log"), "-o", options, "-w",
                    "-t", "60", "start")
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        log = server.log_tail()
        _stop(server)
        pytest.fail(f"PostgreSQL did not start: {exc}\n{exc.stdout or ''}{exc.stderr or ''}\n{log}")
    return server


def _stop(server: PostgresServer) -> None:
    if os.path.exists(os.path.join(server.data, "postmaster.pid")):
        server.tool("pg_ctl", "-D", server.data, "-m", "immediate", "-w", "stop", check=False)
    shutil.rmtree(server.root, ignore_errors=True)


@pytest.fixture(scope="session")
def postgres():
    """The session's PostgreSQL server (started on first use)."""
    bin_dir = bindir()
    if bin_dir is None:
        reason = ("no PostgreSQL binaries (initdb, pg_ctl): install Debian's postgresql package "
                  "(scripts/install_system_deps.sh)")
        if os.environ.get(REQUIRE_ENV):
            pytest.fail(f"{reason}; {REQUIRE_ENV} is set")
        pytest.skip(reason)
    server = _start(bin_dir)
    try:
        yield server
    finally:
        _stop(server)
