"""Dataset upload: peak API memory (RSS above its idle level) and throughput for one large JSONL upload.

Serves the API with uvicorn in a subprocess (SQLite in a scratch data dir; an upload needs no Redis),
uploads a generated JSONL file of `--size-mb` MiB with httpx (streamed multipart), samples the server's RSS
every 20 ms meanwhile, and prints one JSON object per measurement. Target: a 1 GiB upload raises the API's
peak RSS by at most 150 MB. A second upload of one 20 MB line (over PEAGLE_MAX_LINE_BYTES) shows a long
line is refused without being parsed (before the bounded reader it cost ~240 MB).

    python bench/upload.py --size-mb 1024
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
from _common import emit, free_port

from peagle_core.processes import stop_process


def write_jsonl(path: Path, size_bytes: int) -> int:
    """Chat rows of ~2-6 KiB until `size_bytes`; returns the row count."""
    rows = 0
    written = 0
    with open(path, "w") as f:
        while written < size_bytes:
            text = f"answer {rows} " + "lorem ipsum dolor sit amet " * (80 + rows % 150)
            line = json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": f"q{rows}"},
                        {"role": "assistant", "content": text},
                    ]
                }
            )
            f.write(line + "\n")
            written += len(line) + 1
            rows += 1
    return rows


class RssSampler(threading.Thread):
    """Peak RSS of a process (and its children), sampled every `period` seconds until stopped."""

    def __init__(self, pid: int, period: float = 0.02):
        super().__init__(daemon=True)
        self.proc, self.period, self.peak = psutil.Process(pid), period, 0
        self.done = threading.Event()

    def rss(self) -> int:
        return sum(p.memory_info().rss for p in [self.proc, *self.proc.children(recursive=True)])

    def run(self) -> None:
        while not self.done.is_set():
            self.peak = max(self.peak, self.rss())
            time.sleep(self.period)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--size-mb", type=int, default=1024)
    args = ap.parse_args()

    from service.crud.projects import create_key
    from service.db.migrate import upgrade
    from service.db.session import session_scope

    with tempfile.TemporaryDirectory(prefix="peagle-upload-bench-") as tmp:
        data_dir = Path(tmp) / "data"
        data_dir.mkdir()
        db_url = f"sqlite:///{data_dir / 'peagle.db'}"
        upgrade(db_url)
        with session_scope(db_url) as s:
            key, _ = create_key(s, "bench")
        source = Path(tmp) / "upload.jsonl"
        rows = write_jsonl(source, args.size_mb << 20)
        size = source.stat().st_size

        port = free_port()
        env = {
            **os.environ,
            "PEAGLE_DATA_DIR": str(data_dir),
            "PEAGLE_DATABASE_URL": db_url,
            "PEAGLE_MAX_UPLOAD_BYTES": str(size + (1 << 20)),
        }
        cmd = [sys.executable, "-m", "uvicorn", "--factory", "service.app:create_app", "--port", str(port)]
        server = subprocess.Popen([*cmd, "--log-level", "warning"], env=env)
        base = f"http://127.0.0.1:{port}"
        headers = {"Authorization": f"Bearer {key}"}
        try:
            with httpx.Client(base_url=base, timeout=None) as client:
                deadline = time.monotonic() + 60
                while True:
                    try:
                        if client.get("/healthz").status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    if time.monotonic() > deadline:
                        raise RuntimeError("the API did not start")
                    time.sleep(0.2)
                # Warm up: one small upload loads the validation and storage code paths.
                small = b'{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}\n'
                r = client.post("/v1/datasets", files={"file": ("w.jsonl", small)}, headers=headers)
                r.raise_for_status()
                big = _measured_upload(client, headers, server.pid, source)
                assert big.response.status_code == 201 and big.response.json()["num_records"] == rows, (
                    big.response.text
                )
                # One 20 MB line (over PEAGLE_MAX_LINE_BYTES): refused naming the line, never parsed whole.
                long_line = Path(tmp) / "long-line.jsonl"
                turn = {"role": "assistant", "content": "x" * (20 << 20)}
                long_line.write_text(
                    json.dumps({"messages": [{"role": "user", "content": "q"}, turn]}) + "\n"
                )
                long = _measured_upload(client, headers, server.pid, long_line)
                assert long.response.status_code == 422, long.response.text
        finally:
            stop_process(server, grace_s=30)
        mb = size / 1e6
        emit(
            bench="upload",
            metric="peak_rss_increase_mb",
            value=big.peak_increase_mb,
            target_max=150,
            upload_mb=round(mb, 1),
            idle_rss_mb=big.idle_mb,
        )
        emit(
            bench="upload",
            metric="throughput_mb_s",
            value=round(mb / big.seconds, 1),
            upload_mb=round(mb, 1),
            seconds=round(big.seconds, 2),
        )
        emit(
            bench="upload",
            metric="long_line_peak_rss_increase_mb",
            value=long.peak_increase_mb,
            line_mb=round(long_line.stat().st_size / 1e6, 1),
            status=long.response.status_code,
            error=long.response.json()["error"]["message"],
        )


@dataclass
class Measured:
    response: httpx.Response
    seconds: float
    idle_mb: float
    peak_increase_mb: float


def _measured_upload(client: httpx.Client, headers: dict[str, str], pid: int, path: Path) -> Measured:
    """Upload `path` while sampling the API's RSS; peak increase over its level just before."""
    sampler = RssSampler(pid)
    idle = sampler.rss()
    sampler.start()
    t0 = time.perf_counter()
    with open(path, "rb") as f:
        response = client.post("/v1/datasets", files={"file": (path.name, f)}, headers=headers)
    elapsed = time.perf_counter() - t0
    sampler.done.set()
    sampler.join()
    return Measured(response, elapsed, round(idle / 1e6, 1), round((max(sampler.peak, idle) - idle) / 1e6, 1))


if __name__ == "__main__":
    main()
