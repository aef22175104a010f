"""The Python SDK for the peagle HTTP API: one method per route, errors raised as `ClientError`.

Built on httpx; imports nothing from the server side, so it works from any machine that can reach the API.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path, PurePosixPath
from typing import Any

import httpx

from peagle_core.io import sha256_file

TERMINAL_STATUSES = frozenset({"succeeded", "failed", "cancelled"})
_CHUNK = 1 << 20


class ClientError(Exception):
    """An error answer from the API (its `{"error": {...}}` envelope), or a transport failure.

    `status` is the HTTP status, 0 when the server could not be reached at all.
    """

    def __init__(self, status: int, type: str, code: str, message: str, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.type = type
        self.code = code
        self.message = message
        self.param = param

    def __str__(self) -> str:
        where = f" ({self.param})" if self.param and self.param not in self.message else ""
        return f"{self.message}{where} [{self.code}]"

    @classmethod
    def from_response(cls, response: httpx.Response) -> ClientError:
        """Build from an error response; a body that is not our envelope still gives a readable message."""
        try:
            err = response.json()["error"]
            return cls(
                response.status_code,
                str(err.get("type") or "api_error"),
                str(err.get("code") or f"http_{response.status_code}"),
                str(err.get("message") or response.reason_phrase),
                err.get("param"),
            )
        except (ValueError, KeyError, TypeError, AttributeError):
            text = response.text.strip().splitlines()[0][:200] if response.text.strip() else ""
            message = f"HTTP {response.status_code} {response.reason_phrase}" + (f": {text}" if text else "")
            return cls(response.status_code, "http_error", f"http_{response.status_code}", message)


class ChecksumMismatch(ClientError):
    """A downloaded file whose sha256 or size differs from what the API published."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(0, "integrity_error", "checksum_mismatch", message, param)


class PeagleClient:
    """A client for one peagle server and API key.

    `http` lets callers pass their own `httpx.Client` (e.g. FastAPI's TestClient); otherwise one is made.
    """

    def __init__(
        self,
        url: str,
        key: str | None,
        *,
        timeout: float = 60.0,
        http: httpx.Client | None = None,
    ):
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        if http is None:
            http = httpx.Client(base_url=self.url, timeout=timeout)
        http.headers.update(headers)
        self._http = http

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> PeagleClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- plumbing --------------------------------------------------------------------------------

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise ClientError(
                0, "connection_error", "unreachable", f"cannot reach {self.url}: {exc}"
            ) from None
        if response.status_code >= 400:
            raise ClientError.from_response(response)
        return response

    def _json(self, method: str, path: str, **kwargs: Any) -> Any:
        return self._request(method, path, **kwargs).json()

    @staticmethod
    def _params(**params: Any) -> dict[str, Any]:
        return {k: v for k, v in params.items() if v is not None}

    def _paginate(self, path: str, **params: Any) -> Iterator[dict[str, Any]]:
        after = params.pop("after", None)
        while True:
            page = self._json("GET", path, params=self._params(after=after, **params))
            items = page.get("data", [])
            yield from items
            if not page.get("has_more") or not items:
                return
            after = page.get("next_cursor") or items[-1]["id"]

    # -- health ----------------------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        return self._json("GET", "/healthz")

    def ready(self) -> dict[str, Any]:
        return self._json("GET", "/readyz")

    # -- datasets --------------------------------------------------------------------------------

    def upload_dataset(self, path: str | Path, *, filename: str | None = None) -> dict[str, Any]:
        """Upload a JSONL file (streamed as multipart); returns the dataset record."""
        path = Path(path)
        with open(path, "rb") as f:
            files = {"file": (filename or path.name, f, "application/jsonl")}
            return self._json("POST", "/v1/datasets", files=files)

    def list_datasets(self, *, limit: int | None = None, after: str | None = None) -> dict[str, Any]:
        return self._json("GET", "/v1/datasets", params=self._params(limit=limit, after=after))

    def get_dataset(self, dataset_id: str) -> dict[str, Any]:
        return self._json("GET", f"/v1/datasets/{dataset_id}")

    # -- jobs ------------------------------------------------------------------------------------

    def create_job(
        self, spec: dict[str, Any], *, idempotency_key: str | None = None, retries: int = 4
    ) -> dict[str, Any]:
        """POST a job spec (a JobSpec-shaped dict); the server validates it and answers the job record.

        Every create carries an `Idempotency-Key` (a fresh one unless given), so retrying after a 503 or
        a dropped connection, which this does `retries` times with backoff, never creates the job twice.
        """
        headers = {"Idempotency-Key": idempotency_key or f"peagle-{uuid.uuid4().hex}"}
        for attempt in range(retries + 1):
            try:
                return self._json("POST", "/v1/jobs", json={"spec": spec}, headers=headers)
            except ClientError as exc:
                if attempt == retries or not (exc.status == 503 or exc.code == "unreachable"):
                    raise
            time.sleep(min(0.5 * 2**attempt, 8.0))
        raise AssertionError("unreachable")

    def plan_job(
        self, spec: dict[str, Any], *, recalibrate: bool = False, timeout: float = 3600.0
    ) -> dict[str, Any]:
        """What the job would cost (counts, cache bytes, steps, time per stage); creates nothing. A worker
        computes it: this submits the plan and long-polls it until it is answered (`timeout` bounds the
        whole wait). A refused spec or data raises ClientError 422 naming the field or line; no worker
        answering in the server's plan timeout raises 503 `plan_timeout`."""
        params = {"recalibrate": "true"} if recalibrate else None
        plan = self._json("POST", "/v1/jobs/plan", json={"spec": spec}, params=params)
        deadline = time.monotonic() + timeout
        while plan["status"] not in ("succeeded", "failed"):
            wait = min(20.0, max(0.0, deadline - time.monotonic()))
            if wait <= 0:
                raise ClientError(
                    0, "timeout", "plan_wait_timeout", f"plan {plan['id']} not answered in {timeout} s"
                )
            plan = self._json("GET", f"/v1/plans/{plan['id']}", params={"wait": wait}, timeout=wait + 30)
        if plan["status"] == "failed":
            err = plan.get("error") or {}
            code = str(err.get("code") or "plan_failed")
            status = {"plan_timeout": 503, "queue_unavailable": 503, "plan_failed": 502}.get(code, 422)
            raise ClientError(status, str(err.get("type") or "api_error"), code, str(err.get("message")),
                              err.get("param"))  # fmt: skip
        return plan["result"]

    def get_plan(self, plan_id: str, *, wait: float = 0.0) -> dict[str, Any]:
        """A plan as the API stores it (status, result or error), long-polling up to `wait` seconds."""
        return self._json("GET", f"/v1/plans/{plan_id}", params={"wait": wait}, timeout=wait + 30)

    def list_jobs(
        self, *, status: str | None = None, limit: int | None = None, after: str | None = None
    ) -> dict[str, Any]:
        return self._json("GET", "/v1/jobs", params=self._params(status=status, limit=limit, after=after))

    def iter_jobs(
        self, *, status: str | None = None, page_size: int | None = None
    ) -> Iterator[dict[str, Any]]:
        """Every job of the project, newest first, following the cursor across pages of `page_size`."""
        return self._paginate("/v1/jobs", status=status, limit=page_size)

    def get_job(self, job_id: str) -> dict[str, Any]:
        return self._json("GET", f"/v1/jobs/{job_id}")

    def cancel_job(self, job_id: str) -> dict[str, Any]:
        return self._json("POST", f"/v1/jobs/{job_id}/cancel")

    def delete_job(self, job_id: str) -> dict[str, Any]:
        """Delete a finished job with its checkpoints and files."""
        return self._json("DELETE", f"/v1/jobs/{job_id}")

    def delete_dataset(self, dataset_id: str) -> dict[str, Any]:
        return self._json("DELETE", f"/v1/datasets/{dataset_id}")

    def delete_checkpoint(self, checkpoint_id: str) -> dict[str, Any]:
        return self._json("DELETE", f"/v1/checkpoints/{checkpoint_id}")

    def job_events(
        self, job_id: str, *, after: int | str | None = None, limit: int | None = None
    ) -> dict[str, Any]:
        return self._json("GET", f"/v1/jobs/{job_id}/events", params=self._params(after=after, limit=limit))

    def job_metrics(self, job_id: str) -> list[dict[str, Any]]:
        """Every metric point of the job (`step`, `values`), across pages."""
        return list(self._paginate(f"/v1/jobs/{job_id}/metrics"))

    def follow_events(
        self,
        job_id: str,
        *,
        after: int | str | None = None,
        poll_s: float = 1.0,
        on_job: Callable[[dict[str, Any]], None] | None = None,
    ) -> Iterator[dict[str, Any]]:
        """Yield the job's events as they happen until the job is finished and every event was seen.

        Polls the paginated events with a cursor, so a dropped connection or a server restart loses
        nothing; `on_job` sees the job record after each poll (for progress bars).
        """
        while True:
            # Read the status first: events written before a terminal status are then surely visible.
            job = self.get_job(job_id)
            if on_job is not None:
                on_job(job)
            while True:
                page = self.job_events(job_id, after=after)
                events = page.get("data", [])
                yield from events
                if events:
                    after = events[-1]["id"]
                if not page.get("has_more") or not events:
                    break
            if job.get("status") in TERMINAL_STATUSES:
                return
            time.sleep(poll_s)

    def wait(self, job_id: str, *, timeout_s: float, poll_s: float = 1.0) -> dict[str, Any]:
        """Poll until the job reaches a terminal status; raise TimeoutError naming the last status."""
        deadline = time.monotonic() + timeout_s
        while True:
            job = self.get_job(job_id)
            if job.get("status") in TERMINAL_STATUSES:
                return job
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {job.get('status')} after {timeout_s:.0f}s")
            time.sleep(poll_s)

    # -- checkpoints -----------------------------------------------------------------------------

    def list_checkpoints(self, job_id: str) -> dict[str, Any]:
        return self._json("GET", f"/v1/jobs/{job_id}/checkpoints")

    def get_checkpoint(self, checkpoint_id: str) -> dict[str, Any]:
        return self._json("GET", f"/v1/checkpoints/{checkpoint_id}")

    def download_file(
        self,
        checkpoint_id: str,
        name: str,
        dest: str | Path,
        *,
        sha256: str,
        size: int,
        on_bytes: Callable[[int], None] | None = None,
    ) -> Path:
        """Download one checkpoint file to `dest`, resuming a partial `dest.part` through HTTP Range.

        The file appears at `dest` only once its size and sha256 match the published ones; a corrupt
        partial download is discarded and fetched again once.
        """
        dest = Path(dest)
        if _matches(dest, size, sha256):
            if on_bytes is not None:
                on_bytes(size)
            return dest
        dest.parent.mkdir(parents=True, exist_ok=True)
        part = dest.with_name(dest.name + ".part")
        self._fetch_into(checkpoint_id, name, part, size, on_bytes)
        if not _matches(part, size, sha256):
            # Resuming cannot repair a partial file whose bytes were wrong: start over, once.
            part.unlink()
            self._fetch_into(checkpoint_id, name, part, size, on_bytes)
            if not _matches(part, size, sha256):
                part.unlink()
                raise ChecksumMismatch(
                    f"{name}: downloaded bytes do not match the published sha256 {sha256[:12]}…", param=name
                )
        os.replace(part, dest)
        return dest

    def _fetch_into(
        self,
        checkpoint_id: str,
        name: str,
        part: Path,
        size: int,
        on_bytes: Callable[[int], None] | None,
    ) -> None:
        have = part.stat().st_size if part.exists() else 0
        if have > size:
            part.unlink()
            have = 0
        if on_bytes is not None and have:
            on_bytes(have)
        if have == size:
            return
        headers = {"Range": f"bytes={have}-"} if have else {}
        path = f"/v1/checkpoints/{checkpoint_id}/files/{name}"
        try:
            with self._http.stream("GET", path, headers=headers) as response:
                if response.status_code >= 400:
                    response.read()
                    raise ClientError.from_response(response)
                # A server that ignores Range answers 200 with the whole file: start over.
                mode = "ab" if response.status_code == 206 else "wb"
                with open(part, mode) as f:
                    for chunk in response.iter_bytes(_CHUNK):
                        f.write(chunk)
                        if on_bytes is not None:
                            on_bytes(len(chunk))
        except httpx.TransportError as exc:
            raise ClientError(
                0, "connection_error", "unreachable", f"download of {name} broke off: {exc}"
            ) from None

    def download_checkpoint(
        self,
        checkpoint_id: str,
        out_dir: str | Path,
        *,
        on_bytes: Callable[[int], None] | None = None,
        on_total: Callable[[int], None] | None = None,
    ) -> Path:
        """Download every file of a checkpoint into `out_dir` (resumable, sha256-verified per file).

        `on_total(bytes)` is called once with the checkpoint's size, `on_bytes(n)` as bytes arrive.
        """
        ckpt = self.get_checkpoint(checkpoint_id)
        if on_total is not None:
            on_total(sum(int(f["size"]) for f in ckpt["files"]))
        out = Path(out_dir)
        targets = [_inside(out, f["name"]) for f in ckpt["files"]]  # all names checked before any write
        for f, target in zip(ckpt["files"], targets, strict=True):
            self.download_file(
                checkpoint_id,
                f["name"],
                target,
                sha256=f["sha256"],
                size=f["size"],
                on_bytes=on_bytes,
            )
        return out


def _inside(out: Path, name: object) -> Path:
    """`out / name` for a plain relative file name from the server; ClientError for a name that would
    write outside `out` (absolute, `..`, `~`, a backslash, a symlink out of `out`) whatever the server sent."""
    ok = isinstance(name, str) and name and not name.startswith(("/", "~")) and "\\" not in name
    parts = PurePosixPath(name).parts if ok else ()
    if not ok or ".." in parts or "\x00" in name:
        raise ClientError(
            0, "integrity_error", "unsafe_file_name", f"the server sent an unsafe file name {name!r}"
        )
    target = out / PurePosixPath(name)
    if not target.resolve().is_relative_to(out.resolve()):
        raise ClientError(
            0, "integrity_error", "unsafe_file_name", f"file {name!r} would be written outside {out}"
        )
    return target


def _matches(path: Path, size: int, sha256: str) -> bool:
    return path.is_file() and path.stat().st_size == size and sha256_file(path) == sha256
