"""API latency under load: p50/p99 and sustained req/s of GET /v1/jobs/{id} and POST /v1/jobs.

Creates a scratch Postgres database with N existing jobs (written through crud, as the API writes them),
serves the API with uvicorn in a subprocess and drives it from another process at a fixed (open-loop)
request rate with httpx.
Prints one JSON object per measurement on stdout.

    python bench/api_load.py --postgres-url postgresql+psycopg://postgres@127.0.0.1:5432/postgres \
        --redis-url redis://127.0.0.1:6379/0 --rate 100 --duration 20
"""

from __future__ import annotations

import argparse
import json
import tempfile
import uuid
from pathlib import Path
from typing import Any

import _api_harness as harness


def _setup_db(admin_url: str, n_jobs: int, spec: dict[str, Any]) -> tuple[str, str, str, list[str]]:
    from service.crud.jobs import create_job_row
    from service.crud.projects import create_key
    from service.db.session import session_scope

    url, name = harness.scratch_database(admin_url)
    with session_scope(url) as s:
        key, row = create_key(s, "bench")
        project_id = row.project_id
    # The API's own write path (job row + its `queued` event), committed in batches.
    ids: list[str] = []
    for start in range(0, n_jobs, 2000):
        with session_scope(url) as s:
            for _ in range(min(2000, n_jobs - start)):
                ids.append(create_job_row(s, project_id, spec, max_attempts=3).id)
    return name, url, key, ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_service_args(ap)
    ap.add_argument("--jobs", type=int, default=10_000, help="existing jobs to create first")
    ap.add_argument("--rate", type=float, default=100.0, help="requests per second")
    ap.add_argument("--duration", type=float, default=20.0, help="seconds per measurement")
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds of unrecorded load first")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="peagle-bench-"))
    model_dir = tmp / "models" / "verifier"
    model_dir.mkdir(parents=True)
    queue = f"bench-{uuid.uuid4().hex[:8]}"
    spec = {
        "verifier": {"name_or_path": str(model_dir)},
        "dataset": {"path": str(tmp / "d.jsonl"), "seq_len": 64},
        "training": {"total_seq_len": 128},
        "resources": {"queue": queue},
    }
    (tmp / "d.jsonl").write_text('{"messages": []}\n')

    name, url, key, ids = _setup_db(args.postgres_url, args.jobs, spec)
    try:
        with harness.served_api(harness.service_env(tmp, url, args.redis_url)) as base:
            get_paths = [f"/v1/jobs/{i}" for i in ids]
            measurements = [
                ("GET /v1/jobs/{id}", "GET", get_paths, None),
                ("POST /v1/jobs", "POST", ["/v1/jobs"], {"spec": spec}),
            ]
            for label, method, paths, body in measurements:
                harness.InProcess(
                    harness.drive, base, key, method, paths, body, args.rate, args.warmup
                ).result()
                result = harness.InProcess(
                    harness.drive, base, key, method, paths, body, args.rate, args.duration
                ).result()
                print(
                    json.dumps(
                        {
                            "bench": "api_load",
                            "endpoint": label,
                            "backend": "postgres",
                            "existing_jobs": args.jobs,
                            "target_rps": args.rate,
                            "duration_s": args.duration,
                            **result,
                        }
                    ),
                    flush=True,
                )
    finally:
        harness.drop_db(args.postgres_url, name)
        harness.clear_queue(args.redis_url, queue)


if __name__ == "__main__":
    main()
