"""Request and response bodies of the REST API (pydantic); these are what OpenAPI documents."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, field_validator

from peagle_core.spec import JobSpec
from service.db.models import JobStatus
from service.redact import redact_paths


class _Out(BaseModel):
    model_config = ConfigDict(from_attributes=True)


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` entries: each status code answers with the error envelope."""
    return {code: {"model": ErrorEnvelope} for code in codes}


def document_envelope_422(app: Any) -> None:
    """Make `app`'s OpenAPI say what its 422s are: the error envelope. FastAPI documents HTTPValidationError
    on every route with parameters, but the handlers answer every validation error (and the edge checks'
    refusals of path and query strings) with the envelope."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            envelope = {"$ref": "#/components/schemas/ErrorEnvelope"}
            for operations in schema.get("paths", {}).values():
                for operation in operations.values():
                    answer = operation.get("responses", {}).get("422")
                    if answer and "HTTPValidationError" in str(answer):
                        answer["content"] = {"application/json": {"schema": envelope}}
            components = schema.get("components", {}).get("schemas", {})
            components.setdefault(
                "ErrorEnvelope", ErrorEnvelope.model_json_schema(ref_template="#/components/schemas/{model}")
            )
            for unused in ("HTTPValidationError", "ValidationError"):
                components.pop(unused, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


def id_links(param: str, *operation_ids: str, source: str = "$response.body#/id") -> dict[str, Any]:
    """OpenAPI links from a response's id to the operations taking it as the path parameter `param`, so
    clients and stateful tests (Schemathesis) can follow create -> inspect -> cancel -> delete."""
    return {"links": {op: {"operationId": op, "parameters": {param: source}} for op in operation_ids}}


JOB_OPS = (
    "get_job_v1_jobs__job_id__get",
    "cancel_job_v1_jobs__job_id__cancel_post",
    "job_events_v1_jobs__job_id__events_get",
    "job_metrics_v1_jobs__job_id__metrics_get",
    "job_checkpoints_v1_jobs__job_id__checkpoints_get",
    "delete_job_v1_jobs__job_id__delete",
)
DATASET_OPS = ("get_dataset_v1_datasets__dataset_id__get", "delete_dataset_v1_datasets__dataset_id__delete")
CHECKPOINT_OPS = (
    "checkpoint_v1_checkpoints__checkpoint_id__get",
    "archive_v1_checkpoints__checkpoint_id__archive_get",
    "delete_checkpoint_v1_checkpoints__checkpoint_id__delete",
)


class Deleted(BaseModel):
    """The answer to a DELETE: the id is gone, files first, then rows; it now answers 404."""

    id: str
    object: Literal["job", "dataset", "checkpoint"]
    deleted: Literal[True] = True


class ErrorBody(BaseModel):
    type: str = Field(description="Error class: invalid_request_error, not_found_error, ...")
    code: str = Field(description="Stable machine-readable code.")
    message: str = Field(description="What went wrong, naming the field or line.")
    param: str | None = Field(default=None, description="The offending field (dotted path), if any.")


class ErrorEnvelope(BaseModel):
    error: ErrorBody


class JobCreate(BaseModel):
    """`{"spec": {...}}`: the job spec is wrapped so that request-level options can be added later."""

    model_config = ConfigDict(extra="forbid")

    spec: JobSpec


class JobPublic(_Out):
    id: str
    object: Literal["job"] = "job"
    name: str | None
    status: JobStatus
    attempt: int
    max_attempts: int
    queue: str
    progress: dict[str, Any] | None = Field(
        description="stage, step, total_steps, eta_s (while running); once succeeded with "
        "`evaluation.measure_speedup`, `recommendation`: the drafter's `method` (peagle or eagle3, which the serve "
        "command depends on), the K to serve it with (`k`, null when no K beat plain decoding), the best "
        "speed-ups per batch size beside vLLM's ngram, and a `sentence` naming both."
    )
    error: dict[str, Any] | None = Field(
        description="Set when the job failed: `code` (stable), `message` (actionable, never a traceback) and "
        "`param` (the spec field at fault, when one is)."
    )
    spec: dict[str, Any] = Field(description="The resolved job spec (all defaults filled in).")
    spec_submitted: dict[str, Any] | None = Field(
        description="The spec as sent (fields left unset are absent): what the worker runs. Null for jobs "
        "created before it was kept."
    )
    created_at: datetime
    queued_at: datetime | None
    started_at: datetime | None
    finished_at: datetime | None
    cancel_requested_at: datetime | None
    updated_at: datetime

    @field_validator("error")
    @classmethod
    def _redacted(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        # Stored errors are redacted when written; rows written before that are redacted on the way out.
        return redact_paths(v)


PlanStatus = Literal["queued", "running", "succeeded", "failed"]
PLAN_OPS = ("get_plan_v1_plans__plan_id__get",)


class PlanPublic(_Out):
    """A plan request, answered asynchronously: poll it until `status` is succeeded or failed."""

    id: str
    object: Literal["plan"] = "plan"
    status: PlanStatus
    queue: str
    result: dict[str, Any] | None = Field(
        description="When succeeded: counts after preparation, cache bytes per dtype against "
        "`max_cache_bytes` and free space, optimizer steps and a wall-time estimate per stage "
        "(`estimates_from`: calibration or stored)."
    )
    error: ErrorBody | None = Field(
        description="When failed: the spec or data problem (`invalid_request_error`, naming the field or "
        "line), `plan_timeout` (no worker of the queue answered in time) or `plan_failed`."
    )
    created_at: datetime
    deadline_at: datetime = Field(description="A plan unanswered by then fails with plan_timeout.")
    finished_at: datetime | None


class Page(BaseModel):
    has_more: bool
    next_cursor: str | None = Field(default=None, description="Pass as `after` to get the next page.")

    @classmethod
    def of(cls, rows: Sequence[Any], has_more: bool, **extra: Any) -> Self:
        """A page of rows (`data` validated as the list's item type); the cursor is the last row's id."""
        return cls(data=rows, has_more=has_more, next_cursor=str(rows[-1].id) if has_more else None, **extra)


class JobsPublic(Page):
    data: list[JobPublic]


class JobEventPublic(_Out):
    id: int
    job_id: str
    created_at: datetime
    level: str
    type: str
    message: str
    data: dict[str, Any] | None


class JobEventsPublic(Page):
    data: list[JobEventPublic]


class MetricPublic(_Out):
    step: int
    values: dict[str, Any] = Field(
        description="loss, acc_{d}, tokens_per_s, lr, eval/acceptance_length@K, ..."
    )
    created_at: datetime


class MetricsPublic(Page):
    data: list[MetricPublic]


class FileInfo(BaseModel):
    name: str
    size: int
    sha256: str


class CheckpointPublic(_Out):
    id: str
    object: Literal["checkpoint"] = "checkpoint"
    job_id: str
    step: int
    files: list[FileInfo]
    sha256: str = Field(description="sha256 of the canonical file manifest.")
    size: int
    metrics: dict[str, Any] | None
    servable: Literal["verified", "unverified"] = Field(
        description="`verified`: vLLM loaded this checkpoint and its greedy output with the drafter equalled "
        "the verifier's own before it was published; `unverified`: no vLLM where the job ran."
    )
    created_at: datetime


class CheckpointsPublic(BaseModel):
    data: list[CheckpointPublic]


class DatasetPublic(_Out):
    id: str
    object: Literal["dataset"] = "dataset"
    filename: str
    sha256: str
    size: int
    num_records: int
    format: str
    prompts_only_records: int = Field(
        default=0, description="Conversations without an assistant turn (jobs must set dataset.regenerate)."
    )
    created_at: datetime


class DatasetsPublic(Page):
    data: list[DatasetPublic]


class Health(BaseModel):
    status: Literal["ok"] = "ok"


class Readiness(BaseModel):
    status: Literal["ok"] = "ok"
    database: Literal["ok"] = "ok"
    redis: Literal["ok"] = "ok"
