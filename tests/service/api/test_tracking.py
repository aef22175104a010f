"""`tracking.report_to` at the API: validation, and the TensorBoard archive route (scoped per project)."""

from __future__ import annotations

import io
import tarfile

from service.artifacts import ArtifactStore
from service.tracking import tensorboard_key
from tests.service.conftest import create_job


def test_mlflow_is_refused_when_the_server_has_no_tracking_uri(client, auth, spec) -> None:
    spec["tracking"] = {"report_to": ["mlflow"]}
    r = client.post("/v1/jobs", json={"spec": spec}, headers=auth)
    assert r.status_code == 422
    assert r.json()["error"]["param"] == "spec.tracking.report_to"
    assert "PEAGLE_MLFLOW_TRACKING_URI" in r.json()["error"]["message"]


def test_report_to_names_known_trackers_once(client, auth, spec) -> None:
    for bad in (["wandb"], ["tensorboard", "tensorboard"]):
        spec["tracking"] = {"report_to": bad}
        r = client.post("/v1/jobs", json={"spec": spec}, headers=auth)
        assert r.status_code == 422, bad
        assert r.json()["error"]["param"].startswith("spec.tracking.report_to")
    spec["tracking"] = {"report_to": ["tensorboard"]}
    assert create_job(client, auth, spec)["spec"]["tracking"] == {"report_to": ["tensorboard"]}


def test_tensorboard_archive_is_served_to_the_owner_only(client, auth, other_auth, spec, settings) -> None:
    job = create_job(client, auth, spec)
    r = client.get(f"/v1/jobs/{job['id']}/tensorboard", headers=auth)
    assert r.status_code == 404 and r.json()["error"]["code"] == "tensorboard_not_found"

    store = ArtifactStore(settings.artifact_root)
    store.write_bytes(f"{tensorboard_key(job['id'])}/events.out.tfevents.1.host", b"x" * 1000)
    r = client.get(f"/v1/jobs/{job['id']}/tensorboard", headers=auth)
    assert r.status_code == 200 and r.headers["content-type"] == "application/x-tar"
    assert int(r.headers["content-length"]) == len(r.content)
    with tarfile.open(fileobj=io.BytesIO(r.content)) as tar:
        (member,) = tar.getmembers()
        assert member.name == f"{job['id']}-tensorboard/events.out.tfevents.1.host"
        assert tar.extractfile(member).read() == b"x" * 1000

    r = client.get(f"/v1/jobs/{job['id']}/tensorboard", headers=other_auth)
    assert r.status_code == 404 and r.json()["error"]["code"] == "job_not_found"
