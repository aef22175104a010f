"""A private Postgres server for fault drills (bench/chaos.py) and fault tests: its own data directory and
port, stopped and started at will.

Drills that take the database down must never touch the shared server other tests (and other sessions)
use. `PrivatePostgres` runs `initdb` and `pg_ctl` from the installed Postgres (as the `postgres` user when
the tests run as root, since Postgres refuses to run as root) and removes everything on `close()`.
tests/fixtures/pg_cluster.py loads this file for the fault tests.
"""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from worker.rendezvous import free_port


def postgres_bindir() -> Path | None:
    """The directory holding `initdb` and `pg_ctl`, or None when Postgres is not installed."""
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)
    found = shutil.which("pg_ctl")
    if found:
        candidates.insert(0, str(Path(found).parent))
    for d in candidates:
        if (Path(d) / "pg_ctl").is_file() and (Path(d) / "initdb").is_file():
            return Path(d)
    return None


class PrivatePostgres:
    """One throwaway Postgres cluster on 127.0.0.1:`port` with trust auth (user `postgres`)."""

    def __init__(self, bindir: Path):
        self.bindir = bindir
        self.port = free_port()
        # Not under pytest's tmp dir: that is private to root, and the server runs as `postgres`.
        self.root = Path(tempfile.mkdtemp(prefix="peagle-pg-"))
        self.data = self.root / "data"
        # runuser lives in /usr/sbin, which a plain user PATH lacks.
        runuser = shutil.which("runuser") or "/usr/sbin/runuser"
        self._as = [runuser, "-u", "postgres", "--"] if os.geteuid() == 0 else []
        if self._as:
            shutil.chown(self.root, "postgres")
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "--no-sync", "-E", "UTF8")
        self.start()

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, tool: str, *args: str) -> None:
        subprocess.run(
            [*self._as, str(self.bindir / tool), *args], check=True, capture_output=True, cwd=self.root
        )

    def start(self) -> None:
        opts = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._run("pg_ctl", "-D", str(self.data), "-o", opts, "-l", str(self.root / "log"), "-w", "start")

    def stop(self) -> None:
        """A fast shutdown: open connections are cut, as in a failover or a restart."""
        self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop")

    def close(self) -> None:
        with contextlib.suppress(subprocess.CalledProcessError):  # already stopped
            self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop")
        shutil.rmtree(self.root, ignore_errors=True)
