"""Whether this server takes a job spec: the one admission check of `POST /v1/jobs`, `POST /v1/jobs/plan`
and the dashboard's editor (Validate and Submit).

The static part (server paths under the allowed roots, a configured queue, an available tracker, the size
cap on the spec as it would be stored) needs no database; the dataset part reads the project's dataset row, locked when a job is about to be created on
it (so a concurrent DELETE waits and then sees the job).
"""

from __future__ import annotations

from sqlalchemy.orm import Session

from peagle_core.spec import JobSpec
from service.api.dataset_checks import dataset_for_spec
from service.api.doc_size import check_spec_size
from service.api.errors import ApiError
from service.api.quotas import check_queue
from service.db.models import Dataset
from service.paths import check_spec_paths
from service.settings import Settings


def check_trackers(settings: Settings, spec: JobSpec) -> None:
    """422 when the spec reports to a tracker this server has not configured."""
    if "mlflow" in spec.tracking.report_to and not settings.mlflow_tracking_uri:
        raise ApiError(
            422,
            "this server has no MLflow tracking server (PEAGLE_MLFLOW_TRACKING_URI): remove mlflow",
            code="tracker_unavailable",
            param="spec.tracking.report_to",
        )


def admit_spec(
    spec: JobSpec, settings: Settings, project_id: str | None, *, prefix: str = "spec."
) -> JobSpec:
    """The spec with its server paths normalised, if this server runs it for the project; else SpecError
    (a path, naming the field after `prefix`) or ApiError (queue, tracker, size)."""
    # The resolved spec is the larger of the two a job row stores (`spec`, `spec_submitted`): neither
    # passes the cap, whichever door it came through.
    check_spec_size(spec.model_dump(mode="json"), settings.max_spec_bytes)
    spec = check_spec_paths(spec, settings, prefix=prefix, project_id=project_id)
    check_queue(settings, spec.resources.queue)
    check_trackers(settings, spec)
    return spec


def admit_with_dataset(
    db: Session, spec: JobSpec, settings: Settings, project_id: str, *, lock: bool = False
) -> tuple[JobSpec, Dataset | None]:
    """`admit_spec`, then the uploaded dataset the spec names (the project's, trainable as the spec asks);
    None for a spec reading a server path."""
    spec = admit_spec(spec, settings, project_id)
    if spec.dataset.id is None:
        return spec, None
    return spec, dataset_for_spec(db, project_id, spec, lock=lock)
