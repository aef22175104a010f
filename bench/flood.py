"""One project's flood must not slow another's reads: `GET /v1/jobs` p50/p99 of project A, idle and while
project B floods the API with plans (on a queue no worker serves: each waits for its deadline), editor
Validate requests (a 36 KiB spec with 6000 errors) and dataset uploads.

Serves the API with uvicorn in a subprocess on loopback (a scratch Postgres database, or `--sqlite`), drives
A at a fixed open-loop rate from one process and B's flood from another, every loop bounded by the
duration. Prints one JSON object per phase on stdout.

    python bench/flood.py --rate 50 --duration 20 [--sqlite]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import _api_harness as harness
import httpx

CSRF = re.compile(r'name="csrf_token" value="([^"]+)"')


def _setup(args: argparse.Namespace, tmp: Path, queue: str) -> tuple[str, str | None, str, str]:
    """The database URL (and the scratch Postgres database's name), and keys of projects A and B; A gets
    a page of jobs to list."""
    from service.crud.jobs import create_job_row
    from service.crud.projects import create_key
    from service.db.session import session_scope

    url, name = harness.scratch_database(args.postgres_url, sqlite_dir=tmp if args.sqlite else None)
    with session_scope(url) as s:
        key_a, row = create_key(s, "victim")
        key_b, _ = create_key(s, "flooder")
        for _ in range(50):
            create_job_row(s, row.project_id, {"resources": {"queue": queue}}, max_attempts=3)
    return url, name, key_a, key_b


def _spec(tmp: Path, queue: str, **extra: Any) -> dict[str, Any]:
    return {
        "verifier": {"name_or_path": str(tmp / "models" / "verifier")},
        "dataset": {"path": str(tmp / "d.jsonl"), "seq_len": 64},
        "training": {"total_seq_len": 128},
        "resources": {"queue": queue},
        **extra,
    }


async def _flood(
    base: str, key: str, tmp: str, queue: str, duration: float, plan_workers: int, kinds: list[str]
) -> dict[str, Any]:
    """Project B: plan submitters (long-polling what they got), editor Validates and uploads, for `duration`."""
    import yaml

    spec = _spec(Path(tmp), queue)
    bad = _spec(
        Path(tmp),
        queue,
        verifier={"name_or_path": spec["verifier"]["name_or_path"], "layer_ids": ["x"] * 6000},
    )
    bad_yaml = yaml.safe_dump(bad, sort_keys=False)
    row = json.dumps(
        {"messages": [{"role": "user", "content": "q" * 400}, {"role": "assistant", "content": "a"}]}
    )
    upload = ((row + "\n") * 10_000).encode()  # ~4 MiB
    counts: Counter[str] = Counter()
    end = time.monotonic() + duration
    headers = {"Authorization": f"Bearer {key}"}
    limits = httpx.Limits(max_connections=plan_workers + 20)
    async with httpx.AsyncClient(base_url=base, headers=headers, limits=limits, timeout=60) as client:

        async def send(what: str, http: httpx.AsyncClient, method: str, path: str, **kw: Any) -> Any:
            try:
                r = await http.request(method, path, **kw)
            except httpx.HTTPError as exc:  # a reset keep-alive connection: counted, the flood goes on
                counts[f"{what}_{type(exc).__name__}"] += 1
                return None
            counts[f"{what}_{r.status_code}"] += 1
            return r

        async def plans() -> None:
            while time.monotonic() < end:
                r = await send("plan", client, "POST", "/v1/jobs/plan", json={"spec": spec})
                if r is not None and r.status_code == 202:
                    wait = max(0.0, min(20.0, end - time.monotonic()))
                    await send(
                        "plan_poll", client, "GET", f"/v1/plans/{r.json()['id']}", params={"wait": wait}
                    )
                else:
                    await asyncio.sleep(0.05)

        async def edits() -> None:
            async with httpx.AsyncClient(base_url=base, timeout=120) as ui:
                token = CSRF.search((await ui.get("/ui/login")).text).group(1)
                await ui.post("/ui/login", data={"api_key": key, "csrf_token": token})
                token = CSRF.search((await ui.get("/ui/jobs/new")).text).group(1)
                while time.monotonic() < end:
                    form = {"spec_yaml": bad_yaml, "csrf_token": token, "action": "validate"}
                    await send("validate", ui, "POST", "/ui/jobs/new", data=form)

        async def uploads() -> None:
            while time.monotonic() < end:
                r = await send("upload", client, "POST", "/v1/datasets", files={"file": ("d.jsonl", upload)})
                if r is not None and r.status_code == 201:
                    await send("delete", client, "DELETE", f"/v1/datasets/{r.json()['id']}")

        await asyncio.gather(
            *(plans() for _ in range(plan_workers if "plans" in kinds else 0)),
            *(edits() for _ in range(4 if "edits" in kinds else 0)),
            *(uploads() for _ in range(4 if "uploads" in kinds else 0)),
        )
    return dict(sorted(counts.items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_service_args(ap, sqlite=True)
    ap.add_argument("--rate", type=float, default=50.0, help="project A's GET /v1/jobs per second")
    ap.add_argument("--duration", type=float, default=20.0, help="seconds per phase")
    ap.add_argument("--plan-workers", type=int, default=60, help="project B's concurrent plan submitters")
    ap.add_argument(
        "--flood", default="plans,edits,uploads", help="what project B floods with (comma-separated)"
    )
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="peagle-flood-"))
    queue = f"flood-{uuid.uuid4().hex[:8]}"  # configured on the API, but no worker serves it
    (tmp / "models" / "verifier").mkdir(parents=True)
    (tmp / "models" / "verifier" / "config.json").write_text("{}")
    (tmp / "d.jsonl").write_text('{"messages": []}\n')
    url, db_name, key_a, key_b = _setup(args, tmp, queue)
    env = harness.service_env(
        tmp,
        url,
        args.redis_url,
        PEAGLE_QUEUES=f"default,{queue}",
        PEAGLE_PLAN_TIMEOUT_S=str(max(5, int(args.duration))),
    )
    try:
        with harness.served_api(env) as base:
            victim = (base, key_a, "GET", ["/v1/jobs"], None, args.rate)
            backend = "sqlite" if args.sqlite else "postgres"
            asyncio.run(harness.drive(*victim, 3.0))  # warm-up, unrecorded
            for phase in ("idle", "flood"):
                flooder = None
                if phase == "flood":
                    flood_args = (
                        base,
                        key_b,
                        str(tmp),
                        queue,
                        args.duration + 2,
                        args.plan_workers,
                        args.flood.split(","),
                    )
                    flooder = harness.InProcess(_flood, *flood_args)
                    time.sleep(2)  # let the flood build up before measuring
                result = harness.InProcess(harness.drive, *victim, args.duration).result()
                flood = None
                if flooder is not None:
                    # bounded: a dead flooder fails the run
                    flood = flooder.result(timeout=args.duration + 120)
                print(
                    json.dumps(
                        {
                            "bench": "flood",
                            "endpoint": "GET /v1/jobs",
                            "phase": phase,
                            **({"flood": args.flood} if phase == "flood" else {}),
                            "backend": backend,
                            "target_rps": args.rate,
                            "duration_s": args.duration,
                            **result,
                            **({"flood_requests": flood} if flood is not None else {}),
                        }
                    ),
                    flush=True,
                )
    finally:
        if db_name is not None:
            harness.drop_db(args.postgres_url, db_name)
        harness.clear_queue(args.redis_url, queue)


if __name__ == "__main__":
    main()
