"""NaN and Infinity: refused in a job spec with the field named, stored as null in every JSON column."""

from __future__ import annotations

import json
import math

import pytest

from service.crud import jobstate
from service.crud.checkpoints import add_checkpoint, list_for_job
from service.crud.events import add_event
from service.crud.metrics import add_metrics
from service.db.models import Job
from service.db.session import session_factory
from tests.service.conftest import create_job


@pytest.mark.parametrize(
    ("field", "literal"),
    [
        (("training", "grad_clip"), "Infinity"),
        (("training", "lr"), "NaN"),
        (("model", "down_sample_ratio"), "-Infinity"),
    ],
)
def test_nonfinite_spec_values_are_422_naming_the_field(client, auth, spec, field, literal) -> None:
    section, key = field
    spec.setdefault(section, {})[key] = "__X__"
    # Python's json (and FastAPI's body parser) reads the bare tokens NaN/Infinity as floats.
    body = json.dumps({"spec": spec}).replace('"__X__"', literal)
    r = client.post("/v1/jobs", content=body, headers={**auth, "Content-Type": "application/json"})
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["param"] == f"spec.{section}.{key}"
    assert "finite" in err["message"]


def test_nan_and_infinity_are_stored_as_null(client, auth, spec, db_url) -> None:
    job = create_job(client, auth, spec)
    values = {"loss": float("nan"), "grad_norm": float("inf"), "acc_0": 0.5, "nested": [float("-inf"), 1.0]}
    with session_factory(db_url)() as s:
        assert jobstate.transition(s, job["id"], "running", attempt=1)
        add_metrics(s, job["id"], 1, values)
        add_event(s, job["id"], "log", "epoch done", data={"loss": math.nan})
        jobstate.transition(
            s, job["id"], "failed", commit=False, error={"code": "diverged", "loss": math.inf}
        )
        project_id = s.get(Job, job["id"]).project_id
        add_checkpoint(s, job_id=job["id"], project_id=project_id, step=1, uri="x", files=[], metrics=values)
        s.commit()
        (ckpt,) = list_for_job(s, job["id"])
        assert ckpt.metrics["loss"] is None and ckpt.metrics["nested"] == [None, 1.0]

    (row,) = client.get(f"/v1/jobs/{job['id']}/metrics", headers=auth).json()["data"]
    assert row["values"]["loss"] is None and row["values"]["grad_norm"] is None
    assert row["values"]["acc_0"] == 0.5 and row["values"]["nested"] == [None, 1.0]
    got = client.get(f"/v1/jobs/{job['id']}", headers=auth).json()
    assert got["status"] == "failed" and got["error"]["code"] == "diverged"


def test_a_diverged_run_is_stored_with_its_code() -> None:
    from peagle_core.errors import TrainingDiverged
    from worker.job_io import error_for

    err = error_for(TrainingDiverged("loss NaN", param="training.max_nonfinite_steps"), stage="train")
    assert err == {"code": "diverged", "message": "loss NaN", "param": "training.max_nonfinite_steps"}
