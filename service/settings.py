"""Service settings from the environment (prefix `PEAGLE_`), shared by the API, the worker and the CLI."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from peagle_core.data.formats import DEFAULT_MAX_LINE_BYTES


def _split_paths(value: object) -> object:
    # Roots come from the environment as `PEAGLE_ALLOWED_MODEL_ROOTS=/a:/b` (or comma-separated) or JSON.
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            import json

            return json.loads(text)
        sep = "," if "," in text else ":"
        return [p for p in text.split(sep) if p.strip()]
    return value


class Settings(BaseSettings):
    """Everything an operator configures; each field is read from `PEAGLE_<FIELD_NAME>`."""

    model_config = SettingsConfigDict(env_prefix="PEAGLE_", env_file=None, extra="ignore")

    data_dir: Path = Field(
        default=Path("./peagle-data"),
        description="Local state directory: the SQLite file and the default artifact root live here.",
    )
    database_url: str = Field(
        default="",
        description="SQLAlchemy URL of the job database. Postgres in production "
        "(postgresql+psycopg://user@host/db); default: the SQLite file <data_dir>/peagle.db.",
    )
    redis_url: str = Field(
        default="redis://127.0.0.1:6379/0",
        description="Redis URL of the RQ queue; unix:///path/redis.sock?db=0 for the embedded server.",
    )
    artifact_root: str = Field(
        default="",
        description="fsspec URI where datasets and checkpoints are stored (a local directory or s3://...); "
        "default: <data_dir>/artifacts.",
    )
    max_upload_bytes: int = Field(
        default=1 << 30, ge=1, description="Largest dataset upload accepted, in bytes (larger: HTTP 413)."
    )
    max_line_bytes: int = Field(
        default=DEFAULT_MAX_LINE_BYTES,
        ge=1024,
        description="Longest JSONL line a dataset may have, in bytes (bounds validation memory; longer: 422).",
    )
    max_spec_bytes: int = Field(
        default=1 << 20,
        ge=1024,
        description="Largest request body accepted outside dataset uploads (a job spec), in bytes (larger: 413).",
    )
    cancel_grace_s: float = Field(
        default=60.0,
        ge=0,
        description="Seconds a cancelled running job gets to save a checkpoint before it is stopped hard.",
    )
    stage_timeout_s: float = Field(
        default=24 * 3600.0,
        gt=0,
        description="Longest one stage of a job attempt (regenerate, prepare, hidden states, train, eval, "
        "export) may run: past it the stage stops at its next check and the job fails with stage_timeout.",
    )
    allowed_model_roots: Annotated[list[Path], NoDecode] = Field(
        default_factory=list,
        description="Server directories a spec's verifier.name_or_path may point into "
        "(colon- or comma-separated). Empty: no server paths allowed.",
    )
    allowed_data_roots: Annotated[list[Path], NoDecode] = Field(
        default_factory=list,
        description="Server directories a spec's dataset.path may point into (read by every project, so "
        "never a cache's destination).",
    )
    project_files_root: Path | None = Field(
        default=None,
        description="A directory whose `<project id>/` sub-directory is a data root for that project only "
        "(dataset.path, hidden_states.cache_uri); `peagle up` sets it to <data_dir>/projects.",
    )
    allow_hub: bool = Field(
        default=False, description="Allow Hugging Face hub ids (org/name) as verifier.name_or_path."
    )
    allow_trust_remote_code: bool = Field(
        default=False, description="Allow specs with verifier.trust_remote_code: true (runs model code)."
    )
    max_attempts: int = Field(
        default=3, ge=1, description="How many times a job is started before a crash marks it failed."
    )
    job_timeout_s: int = Field(
        default=7 * 24 * 3600, ge=60, description="Hard RQ timeout for one job attempt, in seconds."
    )
    plan_timeout_s: float = Field(
        default=600.0,
        gt=0,
        le=3600,
        description="How long a plan (POST /v1/jobs/plan) may wait for and run on a worker before it fails "
        "with plan_timeout.",
    )
    queues: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["default"],
        min_length=1,
        max_length=64,
        description="The RQ queues this deployment serves (comma-separated). A spec naming another "
        "`resources.queue` is refused (422), and only these appear in `peagle_queue_depth`.",
    )
    max_writes_in_flight_per_caller: int = Field(
        default=8,
        ge=1,
        le=1000,
        description="Write requests (POST, PUT, PATCH, DELETE) one API key or dashboard session may have in "
        "flight per API process (more: 429 at once), so one caller never holds the shared thread pool.",
    )
    max_requests_in_flight_per_caller: int = Field(
        default=16,
        ge=1,
        le=1000,
        description="Requests of any kind one API key, dashboard session or (without either) client address "
        "may have waiting for their answer's head per API process (more: 429 at once, before a thread or a "
        "database connection is taken), so a burst from one caller never holds the thread pool or the "
        "connection pool; an open event stream or download no longer counts once it has started. Keep it "
        "below the thread pool (40) for the guarantee to hold.",
    )
    http_header_timeout_s: float = Field(
        default=10.0,
        gt=0,
        le=300,
        description="Seconds a connection has to deliver a complete request head after it opens or after "
        "its previous answer; then it is closed.",
    )
    http_body_timeout_s: float = Field(
        default=60.0,
        gt=0,
        le=3600,
        description="Seconds after its head within which a request body must be complete, unless it keeps "
        "arriving at PEAGLE_HTTP_BODY_MIN_RATE (averaged since the head); else 408 and the connection closes.",
    )
    http_body_min_rate: int = Field(
        default=64 << 10,
        ge=1,
        le=1 << 30,
        description="Bytes per second a request body must average, past PEAGLE_HTTP_BODY_TIMEOUT_S, to go on "
        "(at the default, an upload of the 1 GiB default cap may take 4.5 hours).",
    )
    http_max_connections_per_peer: int = Field(
        default=64,
        ge=1,
        le=100_000,
        description="Open connections one peer address may hold per API process; more are answered 429 and "
        "closed. Behind a reverse proxy every connection comes from the proxy: raise it to the proxy's own "
        "connection limit there.",
    )
    max_plans_per_key: int = Field(
        default=2, ge=1, le=1000, description="Plans one API key may have in flight at once (more: 429)."
    )
    max_plans_per_project: int = Field(
        default=4,
        ge=1,
        le=1000,
        description="Plans one project may have in flight at once (more: 429); a project's "
        "max_running_jobs lowers it further.",
    )
    reconcile_interval_s: float = Field(
        default=30.0, gt=0, description="How often the reconciler compares the database with the queue."
    )
    worker_heartbeat_s: float = Field(
        default=10.0, gt=0, description="How often a worker records that a running job is still alive."
    )
    worker_address: str = Field(
        default="127.0.0.1",
        min_length=1,
        max_length=253,
        description="This machine's address as the other machines of a multi-node job reach it: where the "
        "worker that leads such a job hosts its torchrun rendezvous (c10d store), and each node's address "
        "in it. Set it on every machine of a multi-node queue.",
    )
    gang_timeout_s: float = Field(
        default=600.0,
        gt=0,
        le=24 * 3600,
        description="How long a multi-node job (resources.nodes > 1) waits for its machines to join before "
        "it fails with gang_incomplete.",
    )
    elastic_max_restarts: int = Field(
        default=3,
        ge=0,
        le=100,
        description='How often an elastic job (resources.nodes "MIN:MAX") re-forms after losing or gaining '
        "a machine before it fails.",
    )
    db_outage_tolerance_s: float = Field(
        default=300.0,
        ge=0,
        description="How long a worker keeps retrying database writes (training goes on, progress is "
        "buffered) before it gives a job up.",
    )

    metrics_token: SecretStr | None = Field(
        default=None,
        description="When set, /metrics shows the cross-project gauges (jobs by status, queue depth) only to "
        "`Authorization: Bearer <token>`; HTTP traffic metrics stay public.",
    )
    max_streams_per_key: int = Field(
        default=8,
        ge=1,
        le=10000,
        description="Open event streams (SSE) one API key may hold per API process (more: 429).",
    )
    retention_days: float | None = Field(
        default=None,
        gt=0,
        description="Delete finished jobs (with their checkpoints and files) this many days after they end; "
        "applied by the reconciler. Unset: keep everything.",
    )
    mlflow_tracking_uri: str = Field(
        default="",
        max_length=4096,
        description="MLflow tracking server for jobs with tracking.report_to: [mlflow] (empty: refused).",
    )
    mlflow_experiment: str = Field(
        default="peagle", max_length=250, description="MLflow experiment that holds one run per job."
    )
    ui_secret_key: str = Field(
        default="",
        max_length=512,
        description="Key that signs web dashboard session cookies; default: a random one kept in "
        "<data_dir>/ui-secret (set it when several API processes share no data dir).",
    )
    ui_secure_cookie: bool | Literal["auto"] = Field(
        default="auto",
        description="The dashboard cookie's Secure flag: true, false, or auto (Secure unless the request is "
        "https-less to a loopback host: localhost, 127.0.0.1, ::1). Behind a TLS-terminating proxy that "
        "forwards plain HTTP, set true.",
    )
    ui_session_max_age_s: int = Field(
        default=12 * 3600, ge=60, le=30 * 24 * 3600, description="How long a dashboard sign-in lasts."
    )

    auth_failures_max: int = Field(
        default=10,
        ge=1,
        le=100_000,
        description="Failed API-key attempts (API bearer or dashboard sign-in) one client address may make "
        "per window; more: 429 with Retry-After until the window ends. Other addresses are unaffected.",
    )
    auth_failures_window_s: int = Field(
        default=300, ge=1, le=86_400, description="The window of auth_failures_max, in seconds."
    )
    auth_failures_store: Literal["auto", "redis", "memory"] = Field(
        default="auto",
        description="Where failed-attempt counters live: redis (shared by every API process; in memory "
        "while Redis is down), memory (per process), or auto (redis when PEAGLE_REDIS_URL is set).",
    )

    events_poll_s: float = Field(
        default=0.5, gt=0, description="How often an SSE event stream polls the database for new events."
    )

    @model_validator(mode="before")
    @classmethod
    def _split_roots(cls, data: object) -> object:
        if isinstance(data, dict):
            for key in ("allowed_model_roots", "allowed_data_roots", "queues"):
                if key in data:
                    data[key] = _split_paths(data[key])
        return data

    @model_validator(mode="after")
    def _derived_defaults(self) -> Settings:
        if not self.database_url:
            self.database_url = f"sqlite:///{(self.data_dir / 'peagle.db').resolve()}"
        if not self.artifact_root:
            self.artifact_root = str((self.data_dir / "artifacts").resolve())
        return self


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings, read once; `get_settings.cache_clear()` re-reads the environment."""
    return Settings()
