"""HTTP Range on every route that serves file bytes (RFC 9110 §14): single ranges answer 206 with exactly
those bytes, unsatisfiable ones 416, malformed values and lists of ranges the whole file once (never 400 or
500); the tar streams and plotly.js ignore Range and always answer the whole body."""

from __future__ import annotations

import io
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from service.artifacts import ArtifactStore
from service.crud.checkpoints import add_checkpoint
from service.crud.jobs import create_job_row
from service.crud.projects import create_key
from service.db.session import session_scope
from service.settings import Settings
from service.tracking import tensorboard_key
from service.ui.data import _plotly
from service.ui.views import HERE
from tests.fixtures.stack import TEST_QUEUES
from tests.service.ui.test_ui import sign_in

MODEL = bytes(range(256)) * 40
FILES = {"config.json": b'{"a": 1}\n', "model.safetensors": MODEL}
EVENTS = {"events.out.tfevents.1.host": b"tb" * 700}
WHOLE = "whole"

# What each Range value must get: (start, end exclusive) -> 206 with those bytes, 416, or the whole file.
Expect = tuple[int, int] | int | str
CASES: dict[str, tuple[Callable[[int], str], Callable[[int], Expect]]] = {
    "first-100": (lambda n: "bytes=0-99", lambda n: (0, 100)),
    "middle": (lambda n: "bytes=100-199", lambda n: (100, 200)),
    "last-byte": (lambda n: f"bytes={n - 1}-{n - 1}", lambda n: (n - 1, n)),
    "open-ended": (lambda n: "bytes=100-", lambda n: (100, n)),
    "suffix": (lambda n: "bytes=-10", lambda n: (n - 10, n)),
    "suffix-past-start": (lambda n: f"bytes=-{n + 5}", lambda n: (0, n)),
    "end-past-file": (lambda n: f"bytes=10-{n + 1000}", lambda n: (10, n)),
    "huge-end": (lambda n: "bytes=0-" + "9" * 5000, lambda n: (0, n)),
    "huge-suffix": (lambda n: "bytes=-" + "9" * 5000, lambda n: (0, n)),
    "unit-any-case": (lambda n: "BYTES=0-9", lambda n: (0, 10)),
    "start-at-size": (lambda n: f"bytes={n}-", lambda n: 416),
    "suffix-zero": (lambda n: "bytes=-0", lambda n: 416),
    "reversed": (lambda n: "bytes=50-10", lambda n: 416),
    "20-digit-start": (lambda n: "bytes=" + "9" * 20 + "-", lambda n: 416),
    "huge-start": (lambda n: "bytes=" + "9" * 5000 + "-", lambda n: 416),
    "letters": (lambda n: "bytes=abc", lambda n: WHOLE),
    "double-dash": (lambda n: "bytes=--1", lambda n: WHOLE),
    "other-unit": (lambda n: "items=0-1", lambda n: WHOLE),
    "no-spec": (lambda n: "bytes=", lambda n: WHOLE),
    "dash-only": (lambda n: "bytes=-", lambda n: WHOLE),
    "three-parts": (lambda n: "bytes=0-1-2", lambda n: WHOLE),
    "no-equals": (lambda n: "bytes 0-1", lambda n: WHOLE),
    "empty": (lambda n: "", lambda n: WHOLE),
    "two-ranges": (lambda n: "bytes=1-2,3-4", lambda n: WHOLE),
    "200-overlapping": (lambda n: "bytes=" + ",".join(["0-1"] * 200), lambda n: WHOLE),
    "200-adjacent": (lambda n: "bytes=" + ",".join(f"{i}-{i}" for i in range(200)), lambda n: WHOLE),
    "unsatisfiable-in-a-list": (lambda n: f"bytes=0-1,{n}-", lambda n: WHOLE),
}


@dataclass(frozen=True)
class Download:
    path: str
    honours_range: bool
    body: bytes | None = None  # the exact bytes of a file
    members: dict[str, bytes] | None = None  # or the member contents of a tar stream (its mtimes vary)
    api: bool = True  # authenticated by the API key, else by the dashboard's session cookie


ROUTES = [
    "api-checkpoint-file",
    "ui-checkpoint-file",
    "ui-static",
    "api-checkpoint-archive",
    "ui-checkpoint-archive",
    "api-tensorboard",
    "ui-tensorboard",
    "ui-plotly",
]


@pytest.fixture(scope="module")
def downloads(
    db_url: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Any, dict[str, str], dict[str, Download]]]:
    """One app per database backend with a checkpoint and TensorBoard files published, a signed-in client
    and the API key's header: ~400 requests, each only reading, so they share it."""
    from fastapi.testclient import TestClient

    from service.app import create_app

    tmp = tmp_path_factory.mktemp("ranges")
    settings = Settings(
        data_dir=tmp / "data",
        database_url=db_url,
        redis_url=redis_url,
        artifact_root=str(tmp / "artifacts"),
        allowed_model_roots=[tmp],
        allowed_data_roots=[tmp],
        queues=TEST_QUEUES,
    )
    store = ArtifactStore(settings.artifact_root)
    src = tmp / "export"
    src.mkdir()
    for name, data in FILES.items():
        (src / name).write_bytes(data)
    with session_scope(db_url) as s:
        key, row = create_key(s, f"ranges-{tmp.name}")
        # A job row only: nothing is enqueued, so the shared Redis database stays empty.
        job = create_job_row(s, row.project_id, {}, max_attempts=1)
        ckpt_id = f"ckpt_{job.id[4:]}"
        files = store.publish_dir(src, f"checkpoints/{ckpt_id}")
        add_checkpoint(
            s,
            job_id=job.id,
            project_id=row.project_id,
            step=1,
            uri=f"checkpoints/{ckpt_id}",
            files=files,
            checkpoint_id=ckpt_id,
        )
        job_id = job.id
    for name, data in EVENTS.items():
        store.write_bytes(f"{tensorboard_key(job_id)}/{name}", data)
    ckpt_members = {f"{ckpt_id}/{n}": d for n, d in FILES.items()}
    tb_members = {f"{job_id}-tensorboard/{n}": d for n, d in EVENTS.items()}
    routes = {
        "api-checkpoint-file": Download(f"/v1/checkpoints/{ckpt_id}/files/model.safetensors", True, MODEL),
        "ui-checkpoint-file": Download(
            f"/ui/checkpoints/{ckpt_id}/files/model.safetensors", True, MODEL, api=False
        ),
        "ui-static": Download(
            "/ui/static/app.js", True, (Path(HERE) / "static" / "app.js").read_bytes(), api=False
        ),
        "api-checkpoint-archive": Download(f"/v1/checkpoints/{ckpt_id}/archive", False, members=ckpt_members),
        "ui-checkpoint-archive": Download(
            f"/ui/checkpoints/{ckpt_id}/archive", False, members=ckpt_members, api=False
        ),
        "api-tensorboard": Download(f"/v1/jobs/{job_id}/tensorboard", False, members=tb_members),
        "ui-tensorboard": Download(f"/ui/jobs/{job_id}/tensorboard", False, members=tb_members, api=False),
        "ui-plotly": Download("/ui/assets/plotly.min.js", False, _plotly()[0], api=False),
    }
    assert sorted(routes) == sorted(ROUTES)
    with TestClient(
        create_app(settings), base_url="http://localhost", raise_server_exceptions=False
    ) as client:
        sign_in(client, key)
        yield client, {"Authorization": f"Bearer {key}"}, routes


def _assert_whole(download: Download, r: Any) -> None:
    assert r.status_code == 200, r.text[:200]
    assert "content-range" not in r.headers
    assert int(r.headers["content-length"]) == len(r.content)
    if download.members is None:
        assert r.content == download.body
    else:
        with tarfile.open(fileobj=io.BytesIO(r.content)) as tar:
            assert {m.name: tar.extractfile(m).read() for m in tar.getmembers()} == download.members


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("route", ROUTES)
def test_range(downloads, route: str, case: str) -> None:
    client, auth, routes = downloads
    download = routes[route]
    size = len(download.body) if download.body is not None else 0
    header, expect = CASES[case]
    r = client.get(download.path, headers={**(auth if download.api else {}), "Range": header(size)})
    want = expect(size) if download.honours_range else WHOLE
    if want == WHOLE:
        _assert_whole(download, r)
    elif want == 416:
        assert r.status_code == 416 and r.headers["content-range"] == f"bytes */{size}"
    else:
        start, end = want
        assert r.status_code == 206 and r.content == download.body[start:end]
        assert r.headers["content-range"] == f"bytes {start}-{end - 1}/{size}"
        assert int(r.headers["content-length"]) == end - start
